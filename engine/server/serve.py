"""Run the app under uvicorn until SIGINT/SIGTERM, then shut down in order: stop admitting, answer
queued requests 503, let running ones finish (cancelled after a grace period), exit 0."""
from __future__ import annotations

import asyncio
import logging
import signal

import uvicorn

from engine.config import EngineConfig, ServerConfig
from engine.server.app import create_app

SHUTDOWN_GRACE_S = 20.0     # running requests get this long to finish before they are cancelled
log = logging.getLogger("pagedserve.server")


class _Server(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, host):
        super().__init__(config)
        self.engine_host = host

    def handle_exit(self, sig: int, frame) -> None:
        # uvicorn's own handler re-raises the signal after shutdown (exit status 143 / 130);
        # a requested stop is a clean one, so only record it here
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True
            return
        if not self.should_exit:
            log.info("%s: draining", signal.Signals(sig).name)
            self.engine_host.drain()
            asyncio.get_event_loop().call_later(SHUTDOWN_GRACE_S, self.engine_host.cancel_all)
        self.should_exit = True


def serve(engine_cfg: EngineConfig, server_cfg: ServerConfig) -> int:
    """Serve until stopped; returns the exit status (1 if the model failed to load)."""
    server: _Server | None = None

    def stop_on_load_failure() -> None:
        server.should_exit = True
    app = create_app(engine_cfg, server_cfg, on_load_failure=stop_on_load_failure)
    config = uvicorn.Config(app, host=server_cfg.host, port=server_cfg.port, access_log=False,
                            timeout_graceful_shutdown=int(SHUTDOWN_GRACE_S) + 10,
                            log_level="info")
    server = _Server(config, app.state.host)
    server.run()
    return 1 if app.state.host.load_error else 0
