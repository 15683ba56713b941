"""The FastAPI app factory: routes, OpenAI-shaped errors, API-key and body-size guards, and the
engine's lifetime (loaded on a thread at startup, closed at shutdown)."""
from __future__ import annotations

import contextlib
import hmac
from typing import Callable

from fastapi import FastAPI
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from engine.config import EngineConfig, ServerConfig
from engine.server import anthropic_routes, fim_routes, openai_routes, responses_routes
from engine.server.admin_routes import router as admin_router
from engine.server.engine_host import EngineHost
from engine.server.errors import APIError, install_error_handlers

OPEN_PATHS = ("/health",)


class Guard:
    """Pure ASGI (streams pass through untouched): the API key on every route but /health, and
    the body size limit, checked before the body reaches JSON parsing."""

    def __init__(self, app: ASGIApp, api_key: str, max_body_bytes: int):
        self.app = app
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        if self.api_key and path not in OPEN_PATHS and not self._authorized(scope):
            return await APIError(401, "missing or wrong API key: send the header "
                                       "`Authorization: Bearer <key>` or `x-api-key: <key>` (server.api_key)",
                                  code="invalid_api_key").response(path)(scope, receive, send)
        body, too_big = await self._read_body(scope, receive)
        if too_big:
            return await APIError(413, f"request body is over server.max_body_bytes = "
                                       f"{self.max_body_bytes:,} bytes",
                                  code="body_too_large").response(path)(scope, receive, send)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()          # after the body: the disconnect, when it comes
        await self.app(scope, replay, send)

    def _authorized(self, scope: Scope) -> bool:
        """`Authorization: Bearer <key>` (OpenAI's clients) or `x-api-key: <key>` (Anthropic's)."""
        headers = dict(scope["headers"])
        scheme, _, token = headers.get(b"authorization", b"").decode("latin-1").partition(" ")
        given = token.strip().encode() if scheme.lower() == "bearer" else headers.get(b"x-api-key", b"").strip()
        return bool(given) and hmac.compare_digest(given, self.api_key.encode())

    async def _read_body(self, scope: Scope, receive: Receive) -> tuple[bytes, bool]:
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_body_bytes:
            return b"", True                # refuse before reading what was announced
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return b"", False
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                return b"", True
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks), False


def create_app(engine_cfg: EngineConfig, server_cfg: ServerConfig, *,
               build: Callable | None = None, on_load_failure: Callable[[], None] = lambda: None
               ) -> FastAPI:
    """`build(engine_cfg) -> EngineClient` defaults to loading the configured model."""
    host = EngineHost(engine_cfg, server_cfg, build)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        host.start_loading(on_load_failure)
        yield
        host.close()

    app = FastAPI(title="pagedserve", lifespan=lifespan)
    app.state.host = host
    install_error_handlers(app)
    for routes in (openai_routes, anthropic_routes, responses_routes, fim_routes):
        app.include_router(routes.router)
    app.include_router(admin_router)
    app.add_middleware(Guard, api_key=server_cfg.api_key, max_body_bytes=server_cfg.max_body_bytes)
    if server_cfg.allowed_origins:  # outside the Guard: a browser's preflight carries no API key
        app.add_middleware(CORSMiddleware, allow_origins=list(server_cfg.allowed_origins),
                           allow_methods=["*"], allow_headers=["*"], expose_headers=["*"])
    return app
