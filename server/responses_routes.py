"""OpenAI's Responses API, stateless: POST /v1/responses over the chat core (the chat template,
tool calls, structured outputs and reasoning of /v1/chat/completions), answered as a response
object or its event stream. Nothing is stored, so nothing can be fetched or continued later."""
from __future__ import annotations

import re
import uuid

from fastapi import APIRouter, Request

from server.chat import Chat, prepare_chat
from server.engine_host import EngineHost, client_label, host_of
from server.errors import APIError
from server.generation import answer
from server.responses_format import ResponsesFormat
from server.responses_schemas import ResponsesRequest
from server.tools import ToolRequest, tool_request

router = APIRouter()
_CHAT_TOOL_PARAM = re.compile(r"^tools\.(\d+)\.function\.")


@router.post("/v1/responses")
async def create_response(body: ResponsesRequest, request: Request):
    host = host_of(request)
    client = host.accept(body)
    offered = body.chat_tools()
    tools = tool_request([tool for _, tool in offered], body.chat_tool_choice(), body.parallel_tool_calls)
    chat = await _prepare(host, body, tools, [where for where, _ in offered])
    rid = f"resp_{uuid.uuid4().hex}"
    params = host.choices(body, len(chat.prompt_ids), chat.grammar)
    handles = host.submit(rid, chat.prompt_ids, params, client=client_label(request, body.user),
                          param="input")
    fmt = ResponsesFormat(rid, body.model or host.names[0], client.tokenizer, chat.output(),
                          body.echoed(params[0]), body.namespaced())
    return await answer(request, host, fmt, rid, handles, stream=body.stream)


async def _prepare(host: EngineHost, body: ResponsesRequest, tools: ToolRequest | None, paths: list[str]) -> Chat:
    """The chat core names chat-completions params in its 400s (`messages`,
    `tools.0.function.parameters`): say them as this API spells them (`paths`: where the request has
    each offered tool)."""
    try:
        return await prepare_chat(host, body.messages(), tools, body.output_grammar(), None)
    except APIError as e:
        param = e.param or ""
        if param == "messages":
            e.param = "input"
        elif _CHAT_TOOL_PARAM.match(param):
            e.param = _CHAT_TOOL_PARAM.sub(lambda m: paths[int(m.group(1))] + ".", param)
            e.message = e.message.replace(param, e.param)
        raise
