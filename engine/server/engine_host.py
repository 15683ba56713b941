"""The server's side of the engine: loads it on a thread (so /health answers 503 meanwhile),
submits requests with errors mapped to HTTP, keeps the in-flight table and drains on shutdown."""
from __future__ import annotations

import logging
import os
import threading
from typing import Callable

from engine.config import EngineConfig, ServerConfig
from engine.server.errors import APIError
from engine.server.metrics import ServerMetrics
from engine.stats import SchedulerStats

log = logging.getLogger("pagedserve.server")


def served_names(model: str) -> tuple[str, ...]:
    """The names the `model` field may use: the configured spec and its basename."""
    base = os.path.basename(model.rstrip("/\\"))
    return tuple(dict.fromkeys(n for n in (model, base) if n))


class EngineHost:
    def __init__(self, engine_cfg: EngineConfig, server_cfg: ServerConfig,
                 build: Callable[[EngineConfig], object] | None = None):
        self.engine_cfg = engine_cfg
        self.server_cfg = server_cfg
        self.names = served_names(engine_cfg.model)
        self.client = None
        self.load_error: str | None = None
        self.draining = False
        self.shed: set[str] = set()           # ids cancelled by shutdown: answered 503
        self.live: dict[str, object] = {}     # id -> RequestHandle, submitted by this server
        self.metrics = ServerMetrics(self.stats)
        self._build = build
        self._loader: threading.Thread | None = None

    # -- lifecycle
    def start_loading(self, on_failure: Callable[[], None]) -> None:
        def load() -> None:
            try:
                build = self._build
                if build is None:
                    from engine.client import EngineClient   # torch: loaded off the event loop
                    build = EngineClient.from_config
                self.client = build(self.engine_cfg)
                log.info("model %s ready", self.engine_cfg.model)
            except Exception as exc:  # noqa: BLE001 - any load failure ends the server with its message
                self.load_error = f"{type(exc).__name__}: {exc}"
                log.error("could not load %s: %s", self.engine_cfg.model, self.load_error)
                on_failure()
        self._loader = threading.Thread(target=load, name="pagedserve-load", daemon=True)
        self._loader.start()

    @property
    def ready(self) -> bool:
        return self.client is not None and not self.draining

    def drain(self) -> None:
        """Stop admitting; cancel queued requests (their clients get 503); running ones go on."""
        self.draining = True
        if self.client is None:
            return
        states = {r.id: r.state for r in self.client.stats().requests}
        for rid in list(self.live):
            if states.get(rid, "waiting") == "waiting":     # not in the table yet = still queued
                self.shed.add(rid)
                self.client.cancel(rid)

    def cancel_all(self) -> None:
        for rid in list(self.live):
            self.client.cancel(rid)

    def close(self) -> None:
        if self.client is not None:
            self.client.close()

    # -- requests
    def require_client(self, admitting: bool = True):
        """The engine client; 503 while loading, and while draining when `admitting` new work."""
        if self.draining and admitting:
            raise APIError(503, "the server is shutting down; retry on another instance",
                           code="shutting_down")
        if self.client is None:
            detail = f"failed: {self.load_error}" if self.load_error else "is still loading"
            raise APIError(503, f"model {self.engine_cfg.model} {detail}; retry when GET /health "
                                "answers 200", code="model_loading")
        return self.client

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in self.names:
            served = " or ".join(repr(n) for n in self.names)
            raise APIError(404, f"model {name!r} is not served here; use {served} (GET /v1/models)",
                           param="model", code="model_not_found")

    def check_token_ids(self, ids: list[int], param: str) -> None:
        vocab = self.require_client().engine.model_config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"token id {bad[0]} is out of range; ids must be in [0, {vocab})",
                           param=param, code="invalid_value")

    def submit(self, request_id: str, *, prompt=None, messages=None, params, client: str):
        from engine.scheduler import QueueFull, RequestRejected
        engine = self.require_client()
        try:
            handle = engine.submit(prompt, messages=messages, params=params,
                                   request_id=request_id, client=client)
        except QueueFull as e:
            raise APIError(503, str(e), code="queue_full") from None
        except RequestRejected as e:
            param = "messages" if messages is not None else "prompt"
            raise APIError(400, str(e), param=param, code="context_length_exceeded") from None
        except Exception as e:  # noqa: BLE001 - a chat template refusing the messages, say
            raise APIError(400, f"could not prepare the prompt: {e}",
                           param="messages" if messages is not None else "prompt") from None
        self.live[request_id] = handle
        return handle

    def release(self, request_id: str) -> None:
        self.live.pop(request_id, None)
        self.shed.discard(request_id)

    def cancel(self, request_id: str) -> bool:
        if self.client is None:
            return False
        known = request_id in self.live or any(r.id == request_id for r in self.stats().requests)
        if known:
            self.client.cancel(request_id)
        return known

    def stats(self) -> SchedulerStats | None:
        return self.client.stats() if self.client is not None else None
