"""The OpenAI-compatible routes: chat and text completions, models, tokenize and detokenize."""
from __future__ import annotations

import dataclasses
import uuid

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from engine.grammar import Grammar
from engine.server.chat import compile_grammar, prepare_chat
from engine.server.engine_host import EngineHost
from engine.server.errors import APIError
from engine.server.generation import Generation
from engine.server.responses import ChatFormat, TextFormat
from engine.server.schemas import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                   SamplingBody, TokenizeRequest)
from engine.server.sse import EventStream
from engine.server.tools import tool_request

router = APIRouter()


def _host(request: Request) -> EngineHost:
    return request.app.state.host


def _client_label(request: Request, user: str | None) -> str:
    """Who asked, for the request table: the `user` field, else the HTTP peer ip:port."""
    if user:
        return user
    peer = request.client
    return f"{peer.host}:{peer.port}" if peer else ""


def _choices(host: EngineHost, body: SamplingBody, prompt_len: int, grammar: Grammar | None) -> list:
    """SamplingParams for each choice: seeded choices use seed + index, as the OpenAI docs ask."""
    info = host.info
    for token_id in body.logit_bias_ids():
        if not 0 <= token_id < info.vocab_size:
            raise APIError(400, f"logit_bias names token id {token_id}; ids must be in "
                                f"[0, {info.vocab_size})", param="logit_bias", code="invalid_value")
    base = body.sampling_params(defaults=info.sampling_defaults,
                                max_tokens=max(1, info.max_model_len - prompt_len), grammar=grammar)
    return [base if base.seed is None else dataclasses.replace(base, seed=base.seed + i)
            for i in range(body.choices)]


async def _run(request: Request, host: EngineHost, body, fmt, completion_id: str, handles,
               want_logprobs: bool):
    generation = Generation(host, completion_id, handles, fmt, want_logprobs=want_logprobs)
    if body.stream:
        return EventStream(generation.events(body.include_usage()),
                           on_close=lambda: host.release(completion_id),
                           send_timeout_s=host.engine_cfg.client_timeout_s,
                           keepalive_s=host.server_cfg.sse_keepalive_s)
    return JSONResponse(await generation.whole(request.receive))


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request):
    host = _host(request)
    host.check_model(body.model)
    client = host.require_client()
    body.check_fields()
    tools = tool_request([t.as_dict() for t in body.tools or ()], body.tool_choice,
                         body.parallel_tool_calls)
    chat = await prepare_chat(host, body.chat(), tools, body.output_grammar(), body.chat_template_kwargs)
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    handles = host.submit(rid, chat.prompt_ids, _choices(host, body, len(chat.prompt_ids), chat.grammar),
                          client=_client_label(request, body.user), param="messages")
    fmt = ChatFormat(rid, body.model or host.names[0], client.tokenizer, [chat.output() for _ in handles],
                     reasoning_field=host.reasoning_parser is not None)
    return await _run(request, host, body, fmt, rid, handles, want_logprobs=body.logprobs)


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request):
    host = _host(request)
    host.check_model(body.model)
    client = host.require_client()
    body.check_fields()
    prompt = body.single_prompt()
    if isinstance(prompt, list):
        host.check_token_ids(prompt, "prompt")
        ids = prompt
    else:
        ids = client.tokenizer.encode(prompt)
    requested = body.output_grammar()
    grammar = requested[0] if requested else None
    if requested:
        await compile_grammar(host, *requested)
    rid = f"cmpl-{uuid.uuid4().hex}"
    handles = host.submit(rid, ids, _choices(host, body, len(ids), grammar),
                          client=_client_label(request, body.user))
    fmt = TextFormat(rid, body.model or host.names[0], client.tokenizer)
    return await _run(request, host, body, fmt, rid, handles, want_logprobs=body.logprobs is not None)


@router.get("/v1/models")
async def list_models(request: Request):
    host = _host(request)
    max_len = host.info.max_model_len if host.info else None
    return {"object": "list", "data": [{"id": name, "object": "model", "created": 0,
                                        "owned_by": "pagedserve", "max_model_len": max_len}
                                       for name in host.names]}


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request):
    host = _host(request)
    host.check_model(body.model)
    tokenizer = host.require_client().tokenizer
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "give exactly one of prompt and messages", param="prompt",
                       code="invalid_value")
    if body.messages is not None:
        messages = [m.for_template(f"messages.{i}") for i, m in enumerate(body.messages)]
        try:
            ids = tokenizer.chat_ids(messages)
        except Exception as e:  # noqa: BLE001 - the template's own refusal, for the client
            raise APIError(400, f"could not apply the chat template: {e}", param="messages") from None
    else:
        ids = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
    return {"tokens": ids, "count": len(ids), "max_model_len": host.info.max_model_len}


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request):
    host = _host(request)
    host.check_model(body.model)
    host.check_token_ids(body.tokens, "tokens")
    return {"prompt": host.client.tokenizer.decode(body.tokens)}
