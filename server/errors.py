"""API errors with the right HTTP status, in the shape of the API that was called: OpenAI's
`{"error": {"message", "type", "param", "code"}}`, on Anthropic's routes (ANTHROPIC_PATHS)
`{"type": "error", "error": {"type", "message"}}`, on Ollama's (OLLAMA_PATHS) `{"error": message}`.

Every failure a client can cause is an APIError (or a validation error mapped here) so it never
surfaces as a 500, and nothing about the engine's state changes because of it.
"""
from __future__ import annotations

import hmac

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from engine.errors import EngineBusy

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error",
          405: "invalid_request_error", 413: "invalid_request_error", 422: "invalid_request_error",
          503: "service_unavailable"}
ANTHROPIC_PATHS = ("/v1/messages",)
OLLAMA_PATHS = ("/api/",)
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
                    429: "rate_limit_error", 503: "overloaded_error"}


class APIError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, type: str | None = None, anthropic_message: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.anthropic_message = anthropic_message      # where Anthropic's API has words of its own
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def _message_with_param(self) -> str:
        """For the shapes with no `param` field: the message names it."""
        return self.message + (f" ({self.param})" if self.param and self.param not in self.message else "")

    def anthropic_body(self) -> dict:
        return {"type": "error", "error": {"type": _ANTHROPIC_TYPES.get(self.status, "api_error"),
                                           "message": self.anthropic_message or self._message_with_param()}}

    def ollama_body(self) -> dict:
        return {"error": self._message_with_param()}

    def response(self, path: str = "") -> JSONResponse:
        """The error for a request to `path`, shaped as that route's API shapes its errors."""
        if path.startswith(ANTHROPIC_PATHS):
            body = self.anthropic_body()
        elif path.startswith(OLLAMA_PATHS):
            body = self.ollama_body()
        else:
            body = self.body()
        return JSONResponse(body, status_code=self.status)


def given_key(headers: dict[bytes, bytes]) -> bytes:
    """The key a request carries: `Authorization: Bearer <key>` (OpenAI's clients) or
    `x-api-key: <key>` (Anthropic's); b"" if none."""
    scheme, _, token = headers.get(b"authorization", b"").decode("latin-1").partition(" ")
    return token.strip().encode() if scheme.lower() == "bearer" else headers.get(b"x-api-key", b"").strip()


def key_matches(given: bytes, key: str) -> bool:
    return bool(key) and bool(given) and hmac.compare_digest(given, key.encode())


def _field(loc) -> str | None:
    # loc is ("body", "messages", 0, "content") or ("query", "limit"); OpenAI names the param as a dotted path
    parts = [str(p) for p in (loc[1:] if loc and loc[0] in ("body", "query") else loc)]
    return ".".join(parts) or None


def validation_error(exc: RequestValidationError) -> APIError:
    first = exc.errors()[0]
    if first.get("type") == "json_invalid":
        return APIError(400, f"request body is not valid JSON: {first.get('ctx', {}).get('error', '')}"
                        .rstrip(": "), code="invalid_json")
    param = _field(first.get("loc", ()))
    problems = "; ".join(f"{_field(e.get('loc', ())) or 'body'}: {e.get('msg')}" for e in exc.errors())
    return APIError(400, problems, param=param, code="invalid_value")


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response(request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(exc).response(request.url.path)

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException) -> JSONResponse:
        detail = str(exc.detail)
        if detail == "There was an error parsing the body":   # FastAPI's words for a JSON that breaks its parser
            detail = ("request body could not be parsed as JSON: it is not JSON, or nested more deeply than "
                      "a JSON parser follows (keep it under a few hundred levels)")
        return APIError(exc.status_code, detail).response(request.url.path)

    @app.exception_handler(EngineBusy)
    async def _busy(request: Request, exc: EngineBusy) -> JSONResponse:
        return APIError(503, str(exc), code="engine_busy").response(request.url.path)

    @app.exception_handler(Exception)
    async def _bug(request: Request, exc: Exception) -> JSONResponse:
        return APIError(500, f"internal error: {type(exc).__name__}: {exc}",
                        type="server_error").response(request.url.path)
