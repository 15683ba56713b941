"""The OpenAI-compatible routes: chat and text completions, models, tokenize and detokenize."""
from __future__ import annotations

import asyncio
import uuid

from fastapi import APIRouter, Request

from server.chat import compile_grammar, prepare_chat
from server.engine_host import client_label, host_of
from server.errors import APIError
from server.fim import fim_prompt, with_fim_stops
from server.fim_routes import require_fim
from server.generation import answer
from server.openai_format import ChatFormat, TextFormat
from server.schemas import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from server.tools import tool_request

router = APIRouter()


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request):
    host = host_of(request)
    client = host.accept(body)
    tools = tool_request([t.as_dict() for t in body.tools or ()], body.tool_choice,
                         body.parallel_tool_calls)
    chat = await prepare_chat(host, body.chat(), tools, body.output_grammar(), body.chat_template_kwargs)
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    handles = host.submit(rid, chat.prompt_ids, host.choices(body, len(chat.prompt_ids), chat.grammar),
                          client=client_label(request, body.user), param="messages")
    fmt = ChatFormat(rid, body.model or host.names[0], client.tokenizer, [chat.output() for _ in handles],
                     want_logprobs=body.logprobs, reasoning_field=host.reasoning_parser is not None)
    return await answer(request, host, fmt, rid, handles, stream=body.stream,
                        include_usage=body.include_usage())


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request):
    host = host_of(request)
    client = host.accept(body)
    prompt = body.single_prompt()
    fim = None
    if body.suffix is not None:     # fill in the middle: the model's FIM prompt around the cursor
        if isinstance(prompt, list):
            raise APIError(400, "suffix needs prompt as a string: the fill-in-the-middle prompt is built "
                                "from the text before and after the cursor; send prompt as text, or token ids "
                                "without suffix", param="suffix", code="invalid_value")
        fim = require_fim(host, "suffix")
        ids = await asyncio.to_thread(fim_prompt, client.tokenizer, fim, prompt, body.suffix)
    elif isinstance(prompt, list):
        host.check_token_ids(prompt, "prompt")
        ids = prompt
    else:   # a long prompt tokenizes for a while: off the event loop
        ids = await asyncio.to_thread(client.tokenizer.encode, prompt)
    requested = body.output_grammar()
    grammar = requested[0] if requested else None
    if requested:
        await compile_grammar(host, *requested)
    params = host.choices(body, len(ids), grammar)
    rid = f"cmpl-{uuid.uuid4().hex}"
    handles = host.submit(rid, ids, params if fim is None else with_fim_stops(params, fim),
                          client=client_label(request, body.user))
    fmt = TextFormat(rid, body.model or host.names[0], client.tokenizer, want_logprobs=body.logprobs is not None)
    return await answer(request, host, fmt, rid, handles, stream=body.stream,
                        include_usage=body.include_usage())


def _model_card(host, name: str) -> dict:
    """A served model as both SDKs read one: OpenAI's keys (object, created, owned_by) and Anthropic's
    (type, display_name, created_at); each ignores the other's."""
    return {"id": name, "object": "model", "created": 0, "owned_by": "pagedserve", "type": "model",
            "display_name": name, "created_at": "1970-01-01T00:00:00Z",
            "max_model_len": host.info.max_model_len if host.info else None}


@router.get("/v1/models")
async def list_models(request: Request):
    host = host_of(request)
    return {"object": "list", "data": [_model_card(host, name) for name in host.names], "has_more": False,
            "first_id": host.names[0], "last_id": host.names[-1]}


@router.get("/v1/models/{model:path}")
async def retrieve_model(model: str, request: Request):
    host = host_of(request)
    host.check_model(model)        # 404 model_not_found, naming what is served
    return _model_card(host, model)


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request):
    host = host_of(request)
    host.check_model(body.model)
    tokenizer = host.require_client().tokenizer
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "give exactly one of prompt and messages", param="prompt",
                       code="invalid_value")
    if body.messages is not None:
        messages = [m.for_template(f"messages.{i}") for i, m in enumerate(body.messages)]
        try:
            ids = await asyncio.to_thread(tokenizer.chat_ids, messages)
        except Exception as e:  # noqa: BLE001 - the template's own refusal, for the client
            raise APIError(400, f"could not apply the chat template: {e}", param="messages") from None
    else:
        ids = await asyncio.to_thread(tokenizer.encode, body.prompt, add_special_tokens=body.add_special_tokens)
    return {"tokens": ids, "count": len(ids), "max_model_len": host.info.max_model_len}


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request):
    host = host_of(request)
    host.check_model(body.model)
    host.check_token_ids(body.tokens, "tokens")
    return {"prompt": host.client.tokenizer.decode(body.tokens)}
