"""Run the app under uvicorn until SIGINT/SIGTERM/SIGHUP, then shut down in order: stop admitting,
answer queued requests 503, let running ones finish (cancelled after a grace period), exit 0. While
it drains it still listens, so /health answers 503 "draining" and new requests a 503 instead of a
refused connection; a second SIGINT stops at once."""
from __future__ import annotations

import asyncio
import copy
import logging
import signal
import time

import uvicorn

from engine.config import EngineConfig, ServerConfig
from server.app import create_app
from server.protocol import header_deadline_protocol

SHUTDOWN_GRACE_S = 20.0     # running requests get this long to finish before they are cancelled
log = logging.getLogger("pagedserve.server")


class _Server(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, host):
        super().__init__(config)
        self.engine_host = host

    def handle_exit(self, sig: int, frame) -> None:
        # uvicorn's own handler re-raises the signal after shutdown (exit status 143 / 130);
        # a requested stop is a clean one, so only record it here
        if self.engine_host.draining:
            if sig == signal.SIGINT:
                self.should_exit = self.force_exit = True
            return
        log.info("%s: draining", signal.Signals(sig).name)
        self.engine_host.drain()
        asyncio.get_event_loop().create_task(self._exit_when_drained())

    async def _exit_when_drained(self) -> None:
        """uvicorn stops listening once should_exit is set: set it when the running requests are done
        (or the grace period is over and they are cancelled)."""
        deadline = time.monotonic() + SHUTDOWN_GRACE_S
        while self.engine_host.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        self.engine_host.cancel_all()
        self.should_exit = True


def serve(engine_cfg: EngineConfig, server_cfg: ServerConfig) -> int:
    """Serve until stopped; returns the exit status (1 if the model failed to load)."""
    server: _Server | None = None

    def stop_on_load_failure() -> None:
        server.should_exit = True
    app = create_app(engine_cfg, server_cfg, on_load_failure=stop_on_load_failure)
    # pagedserve's own lines (model ready, draining, the prefix cache restored and saved) go where
    # uvicorn's go, in its format
    log_config = copy.deepcopy(uvicorn.config.LOGGING_CONFIG)
    log_config["loggers"]["pagedserve"] = {"handlers": ["default"], "level": "INFO", "propagate": False}
    config = uvicorn.Config(app, host=server_cfg.host, port=server_cfg.port, access_log=False,
                            timeout_graceful_shutdown=10, log_level="info", log_config=log_config,
                            http=header_deadline_protocol(server_cfg.header_timeout_s))
    server = _Server(config, app.state.host)
    # a closed terminal stops the server as SIGTERM does (the prefix cache is saved); under nohup the
    # signal stays ignored
    if signal.getsignal(signal.SIGHUP) is signal.SIG_DFL:
        signal.signal(signal.SIGHUP, server.handle_exit)
    server.run()
    return 1 if app.state.host.load_error else 0
