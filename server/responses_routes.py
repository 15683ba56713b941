"""OpenAI's Responses API: POST /v1/responses over the chat core (the chat template, tool calls,
structured outputs and reasoning of /v1/chat/completions), answered as a response object or its
event stream; the answers kept in memory (server/response_store.py) are continued with
previous_response_id, and fetched, listed by input item or deleted by id."""
from __future__ import annotations

import re
import uuid
from typing import Literal

from fastapi import APIRouter, Query, Request

from server.chat import Chat, prepare_chat
from server.engine_host import EngineHost, client_label, host_of
from server.errors import APIError
from server.generation import answer
from server.responses_format import ResponsesFormat
from server.response_store import Kept, ResponseStore
from server.responses_schemas import ResponsesRequest, as_items
from server.tools import ToolRequest, tool_request

router = APIRouter()
_CHAT_TOOL_PARAM = re.compile(r"^tools\.(\d+)\.function\.")


@router.post("/v1/responses")
async def create_response(body: ResponsesRequest, request: Request):
    host, store = host_of(request), _store(request)
    client = host.accept(body)
    stored = store.storing(body.store)
    earlier = store.get(body.previous_response_id, "previous_response_id").context \
        if body.previous_response_id else []
    offered = body.chat_tools()
    tools = tool_request([tool for _, tool in offered], body.chat_tool_choice(), body.parallel_tool_calls)
    chat = await _prepare(host, body, tools, [where for where, _ in offered], earlier)
    rid = f"resp_{uuid.uuid4().hex}"
    params = host.choices(body, len(chat.prompt_ids), chat.grammar)
    handles = host.submit(rid, chat.prompt_ids, params, client=client_label(request, body.user),
                          param="input")

    def keep(response: dict) -> None:
        store.put(rid, Kept(response, body.input_items(), earlier + body.items() + as_items(response["output"])))

    fmt = ResponsesFormat(rid, body.model or host.names[0], client.tokenizer, chat.output(),
                          body.echoed(params[0], stored), body.namespaced(), keep if stored else None)
    return await answer(request, host, fmt, rid, handles, stream=body.stream)


@router.get("/v1/responses/{response_id}")
async def get_response(response_id: str, request: Request, stream: bool = False) -> dict:
    kept = _store(request).get(response_id)
    if stream:
        raise APIError(400, "stream is not supported here: only a background response can be streamed again, "
                            "and this server runs none; leave stream out", param="stream", code="unsupported_value")
    return kept.response


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, request: Request) -> dict:
    _store(request).delete(response_id)
    return {"id": response_id, "object": "response", "deleted": True}


@router.post("/v1/responses/{response_id}/cancel")
async def cancel_response(response_id: str, request: Request) -> dict:
    _store(request).get(response_id)
    raise APIError(400, f"response {response_id!r} has finished: only a background response can be cancelled, "
                        "and this server runs none (a client stops its own request by closing it)",
                   code="invalid_value")


@router.get("/v1/responses/{response_id}/input_items")
async def list_input_items(response_id: str, request: Request, after: str | None = None,
                           limit: int = Query(20, ge=1, le=100), order: Literal["asc", "desc"] = "desc") -> dict:
    items = _store(request).get(response_id).inputs
    items = items[::-1] if order == "desc" else items
    start = 0
    if after is not None:
        ids = [item["id"] for item in items]
        if after not in ids:
            raise APIError(400, f"after={after!r} is not an input item of {response_id!r}", param="after",
                           code="invalid_value")
        start = ids.index(after) + 1
    page = items[start:start + limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": start + limit < len(items)}


def _store(request: Request) -> ResponseStore:
    return request.app.state.responses


async def _prepare(host: EngineHost, body: ResponsesRequest, tools: ToolRequest | None, paths: list[str],
                   earlier: list) -> Chat:
    """The chat core names chat-completions params in its 400s (`messages`,
    `tools.0.function.parameters`): say them as this API spells them (`paths`: where the request has
    each offered tool)."""
    try:
        return await prepare_chat(host, body.messages(earlier), tools, body.output_grammar(), None)
    except APIError as e:
        param = e.param or ""
        if param == "messages":
            e.param = "input"
        elif _CHAT_TOOL_PARAM.match(param):
            e.param = _CHAT_TOOL_PARAM.sub(lambda m: paths[int(m.group(1))] + ".", param)
            e.message = e.message.replace(param, e.param)
        raise
