"""`pagedserve serve` as a child process on a free loopback port, for the server tests and the
server overhead bench (bench/test_server_overhead.py puts this directory on sys.path)."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`pagedserve serve` on a free loopback port; `health` records every /health status seen.

    The defaults suit the tests' tiny fp32 checkpoints; `flags` go to `serve` after the named
    settings. `workdir`: the server's working directory (so no config.toml there applies) and where
    its log goes; without it the server inherits this process's directory and logs next to the model.
    """

    def __init__(self, model: Path | str, *flags: str, dtype: str = "float32",
                 max_model_len: int = 256, kv_pool_tokens: int = 4096,
                 env: dict[str, str] | None = None, workdir: Path | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        log_dir = Path(model).parent if workdir is None else Path(workdir)
        self.log = open(log_dir / f"server-{self.port}.log", "w+b")
        exe = Path(sys.executable).with_name("pagedserve")
        self.proc = subprocess.Popen(
            [str(exe), "serve", "--model", str(model), "--dtype", dtype, "--port", str(self.port),
             "--max-model-len", str(max_model_len), "--kv-pool-tokens", str(kv_pool_tokens), *flags],
            stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
            cwd=workdir)
        self.health: list[int] = []
        self.api_key = flags[flags.index("--api-key") + 1] if "--api-key" in flags else ""

    def wait_ready(self, timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.output()}")
            try:
                self.health.append(httpx.get(self.url + "/health", timeout=5).status_code)
            except httpx.TransportError:
                pass                        # not listening yet
            if self.health and self.health[-1] == 200:
                return self._warm_up(deadline - time.monotonic())
            time.sleep(0.05)
        raise TimeoutError(f"server not ready after {timeout} s:\n{self.output()}")

    def _warm_up(self, timeout: float) -> None:
        # the first step of a fresh engine is slow (one-time kernel setup); nothing should time that
        auth = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        httpx.post(self.url + "/v1/completions", json={"prompt": "warm", "max_tokens": 2},
                   headers=auth, timeout=timeout)

    def __enter__(self) -> "ServerProcess":
        """`with ServerProcess(...) as srv:` waits until it serves, and at the end stops it and
        checks it exited cleanly (status 0)."""
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        out = self.output()
        assert self.stop() == 0, out

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read().decode(errors="replace")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
            self.log.close()
