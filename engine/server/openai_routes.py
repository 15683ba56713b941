"""The OpenAI-compatible routes: chat and text completions, models, tokenize and detokenize."""
from __future__ import annotations

import uuid

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from engine.server.engine_host import EngineHost
from engine.server.errors import APIError
from engine.server.generation import Generation
from engine.server.responses import ChatFormat, TextFormat
from engine.server.schemas import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                   TokenizeRequest)
from engine.server.sse import EventStream

router = APIRouter()


def _host(request: Request) -> EngineHost:
    return request.app.state.host


def _client_label(request: Request, user: str | None) -> str:
    """Who asked, for the request table: the `user` field, else the HTTP peer ip:port."""
    if user:
        return user
    peer = request.client
    return f"{peer.host}:{peer.port}" if peer else ""


async def _run(request: Request, host: EngineHost, body, fmt, handle, want_logprobs: bool):
    generation = Generation(host, handle, fmt, want_logprobs=want_logprobs)
    if body.stream:
        return EventStream(generation.events(body.include_usage()),
                           on_close=lambda: host.release(handle.id),
                           send_timeout_s=host.engine_cfg.client_timeout_s)
    return JSONResponse(await generation.whole(request.receive))


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request):
    host = _host(request)
    host.check_model(body.model)
    params = body.sampling_params()
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    handle = host.submit(rid, messages=body.chat(), params=params,
                         client=_client_label(request, body.user))
    fmt = ChatFormat(rid, body.model or host.names[0], host.client.tokenizer)
    return await _run(request, host, body, fmt, handle, want_logprobs=body.logprobs)


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request):
    host = _host(request)
    host.check_model(body.model)
    params = body.sampling_params()
    prompt = body.single_prompt()
    if isinstance(prompt, list):
        host.check_token_ids(prompt, "prompt")
    rid = f"cmpl-{uuid.uuid4().hex}"
    handle = host.submit(rid, prompt=prompt, params=params, client=_client_label(request, body.user))
    fmt = TextFormat(rid, body.model or host.names[0], host.client.tokenizer)
    return await _run(request, host, body, fmt, handle, want_logprobs=body.logprobs is not None)


@router.get("/v1/models")
async def list_models(request: Request):
    host = _host(request)
    return {"object": "list", "data": [{"id": host.names[0], "object": "model", "created": 0,
                                        "owned_by": "pagedserve",
                                        "max_model_len": host.client.engine.max_model_len
                                        if host.client else None}]}


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request):
    host = _host(request)
    host.check_model(body.model)
    tokenizer = host.require_client().tokenizer
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "give exactly one of prompt and messages", param="prompt",
                       code="invalid_value")
    if body.messages is not None:
        try:
            ids = tokenizer.chat_ids([{"role": m.role, "content": m.text()} for m in body.messages])
        except Exception as e:  # noqa: BLE001 - the template's own refusal, for the client
            raise APIError(400, f"could not apply the chat template: {e}", param="messages") from None
    else:
        ids = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
    return {"tokens": ids, "count": len(ids), "max_model_len": host.client.engine.max_model_len}


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request):
    host = _host(request)
    host.check_model(body.model)
    host.check_token_ids(body.tokens, "tokens")
    return {"prompt": host.client.tokenizer.decode(body.tokens)}
