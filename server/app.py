"""The FastAPI app factory: routes, OpenAI-shaped errors, API-key and body-size guards, and the
engine's lifetime (loaded on a thread at startup, closed at shutdown)."""
from __future__ import annotations

import contextlib
import re
from typing import Callable

from fastapi import FastAPI
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from engine.config import EngineConfig, ServerConfig
from server import anthropic_routes, fim_routes, ollama_routes, openai_routes, responses_routes
from server.admin_routes import router as admin_router
from server.engine_host import EngineHost
from server.errors import OLLAMA_PATHS, APIError, given_key, install_error_handlers, key_matches
from server.response_store import ResponseStore

OPEN_PATHS = ("/health",)
_SURROGATE_HINT = re.compile(rb"\\u[dD][89a-fA-F]")
_ESCAPE = re.compile(rb"\\(?:u([0-9a-fA-F]{4})|.)", re.S)


def lone_surrogate(body: bytes) -> str | None:
    """The first \\uD800-\\uDFFF escape in a JSON body that is not half of a surrogate pair, or None.
    Such a string is no Unicode: the tokenizer and the JSON encoder of any answer that echoes it
    fail on it, so it is refused at the door. Escapes are read in order, so an escaped backslash
    before "ud800" is not mistaken for one."""
    if not _SURROGATE_HINT.search(body):
        return None
    high = None                     # (where it ends, its code) while a high half waits for its low one
    for m in _ESCAPE.finditer(body):
        code = int(m.group(1), 16) if m.group(1) else -1
        if high is not None:
            if 0xDC00 <= code <= 0xDFFF and m.start() == high[0]:
                high = None
                continue
            return f"\\u{high[1]:04x}"
        if 0xD800 <= code <= 0xDBFF:
            high = (m.end(), code)
        elif 0xDC00 <= code <= 0xDFFF:
            return f"\\u{code:04x}"
    return None if high is None else f"\\u{high[1]:04x}"


class Guard:
    """Pure ASGI (streams pass through untouched): the API key on every route but /health, and
    the body size limit, checked before the body reaches JSON parsing."""

    def __init__(self, app: ASGIApp, api_key: str, max_body_bytes: int, admin_key: str = ""):
        self.app = app
        self.api_key = api_key
        self.admin_key = admin_key          # the operator's key opens every route too
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
        try:    # JSON is UTF-8; a lenient decoder would let invalid bytes (a surrogate's, say) through
            body.decode("utf-8")
        except UnicodeDecodeError as e:
            return await APIError(400, f"request body is not valid UTF-8 (byte {e.start}: "
                                       f"{body[e.start:e.start + 4]!r}); send JSON encoded as UTF-8",
                                  code="invalid_json").response(path)(scope, receive, send)
        surrogate = lone_surrogate(body)
        if surrogate:
            return await APIError(400, f"request body holds a lone UTF-16 surrogate ({surrogate}) in a "
                                       "string; strings must be valid Unicode (a high surrogate "
                                       "\\ud800-\\udbff needs its low half right after it)",
                                  code="invalid_value").response(path)(scope, receive, send)
        if path.startswith(OLLAMA_PATHS):   # Ollama reads any body as JSON (its docs' curl sends no type)
            scope = dict(scope, headers=[(k, v) for k, v in scope["headers"] if k != b"content-type"]
                         + [(b"content-type", b"application/json")])
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()          # after the body: the disconnect, when it comes
        await self.app(scope, replay, send)

    def _authorized(self, scope: Scope) -> bool:
        given = given_key(dict(scope["headers"]))
        return key_matches(given, self.api_key) or key_matches(given, self.admin_key)

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
    app.state.responses = ResponseStore(server_cfg.responses_store)
    install_error_handlers(app)
    for routes in (openai_routes, anthropic_routes, responses_routes, fim_routes, ollama_routes):
        app.include_router(routes.router)
    app.include_router(admin_router)
    app.add_middleware(Guard, api_key=server_cfg.api_key, max_body_bytes=server_cfg.max_body_bytes,
                       admin_key=server_cfg.admin_key)
    if server_cfg.allowed_origins:  # outside the Guard: a browser's preflight carries no API key
        app.add_middleware(CORSMiddleware, allow_origins=list(server_cfg.allowed_origins),
                           allow_methods=["*"], allow_headers=["*"], expose_headers=["*"])
    return app
