"""Anthropic's Messages API: POST /v1/messages and /v1/messages/count_tokens. The same chat core as
the OpenAI routes (server/chat.py: template, tools, grammars, reasoning); only the wire
format differs. Errors on these routes take Anthropic's shape (server/errors.py)."""
from __future__ import annotations

import uuid

from fastapi import APIRouter, Request

from server.anthropic_format import MessageFormat
from server.anthropic_schemas import CountTokensRequest, MessagesRequest
from server.chat import Chat, prepare_chat
from server.engine_host import EngineHost, client_label, host_of
from server.generation import answer
from server.tools import renders_tools_first, tool_request

router = APIRouter()


async def _chat(host: EngineHost, body: MessagesRequest) -> Chat:
    host.accept(body)
    choice = body.tool_choice
    tools = tool_request(body.openai_tools(), choice.as_openai() if choice else None,
                         not (choice and choice.disable_parallel_tool_use))
    tools_first = renders_tools_first(host.require_client().tokenizer)
    return await prepare_chat(host, body.chat(tools_first), tools, body.output_grammar(), body.template_kwargs(),
                              body.prefill())


@router.post("/v1/messages")
async def messages(body: MessagesRequest, request: Request):
    host = host_of(request)
    chat = await _chat(host, body)
    rid = f"msg_{uuid.uuid4().hex}"
    handles = host.submit(rid, chat.prompt_ids, host.choices(body, len(chat.prompt_ids), chat.grammar),
                          client=client_label(request, body.user), param="messages")
    fmt = MessageFormat(rid, body.model or host.names[0], host.client.tokenizer, chat.output(),
                        len(chat.prompt_ids))
    return await answer(request, host, fmt, rid, handles, stream=body.stream)


@router.post("/v1/messages/count_tokens")
async def count_tokens(body: CountTokensRequest, request: Request):
    chat = await _chat(host_of(request), body)
    return {"input_tokens": len(chat.prompt_ids)}
