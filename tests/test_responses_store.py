"""The Responses API's kept responses through the official `openai` client against a real
`pagedserve serve` on a tiny random model: previous_response_id continues a conversation (the same
prompt as sending it whole, from the prefix cache), a function call answered that way, retrieve,
input items, delete, what these routes refuse, and the store's own limits."""
from __future__ import annotations

import httpx
import openai
import pytest

from server.errors import APIError
from server.response_store import Kept, ResponseStore

from chat_templates import HERMES, chat_server
from test_responses_api import ASK, GENERATION, TOOLS, _client


@pytest.fixture(scope="module")
def hermes(tmp_path_factory, tiny_checkpoint):
    with chat_server(tmp_path_factory, tiny_checkpoint, "tiny-hermes", HERMES, "--served-model-name", "tiny",
                     generation=GENERATION) as srv:
        yield srv


def test_previous_response_id_continues_the_conversation_from_the_prefix_cache(hermes):
    client = _client(hermes)
    first = client.responses.create(model="tiny", input=ASK, instructions="Be brief.", max_output_tokens=8)
    assert first.store and first.previous_response_id is None
    second = client.responses.create(model="tiny", previous_response_id=first.id, input="And in Rome?",
                                     max_output_tokens=8)
    assert second.previous_response_id == first.id
    # the same turn with the whole conversation sent (the earlier instructions are not carried over)
    whole = [{"role": "user", "content": ASK}, {"role": "assistant", "content": first.output_text},
             {"role": "user", "content": "And in Rome?"}]
    sent = client.responses.create(model="tiny", input=whole, max_output_tokens=8, store=False)
    assert (second.usage.input_tokens, second.output_text) == (sent.usage.input_tokens, sent.output_text)
    assert second.usage.input_tokens > first.usage.input_tokens
    third = client.responses.create(model="tiny", previous_response_id=second.id, input="Thanks.",
                                    max_output_tokens=8, stream=True)
    final = list(third)[-1].response
    # the third turn reads the second's prompt from the cache (all of it but a partial last block)
    assert final.usage.input_tokens_details.cached_tokens >= second.usage.input_tokens // 16 * 16 > 0
    assert client.responses.retrieve(final.id).output_text == final.output_text    # a stream is kept too


def test_a_function_call_answered_through_previous_response_id(hermes):
    client = _client(hermes)
    first = client.responses.create(model="tiny", input=ASK, tools=TOOLS, tool_choice="required",
                                    parallel_tool_calls=False, max_output_tokens=200)
    (call,) = first.output
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}
    chained = client.responses.create(model="tiny", previous_response_id=first.id, input=[result], tools=TOOLS,
                                      tool_choice="none", max_output_tokens=6)
    sent = client.responses.create(model="tiny", input=[{"role": "user", "content": ASK},
                                                        call.model_dump(exclude_none=True), result],
                                   tools=TOOLS, tool_choice="none", max_output_tokens=6, store=False)
    assert (chained.usage.input_tokens, chained.output_text) == (sent.usage.input_tokens, sent.output_text)


def test_a_kept_response_is_retrieved_listed_and_deleted(hermes):
    client = _client(hermes)
    items = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello."},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "more"}]}]
    out = client.responses.create(model="tiny", input=items, max_output_tokens=4, metadata={"k": "v"})
    assert client.responses.retrieve(out.id).model_dump() == out.model_dump()
    listed = client.responses.input_items.list(out.id)
    assert [(i.role, i.content[0].text) for i in listed.data] == [("user", "more"), ("assistant", "Hello."),
                                                                  ("user", "hi")]      # newest first
    assert all(i.id.startswith("msg_") and i.type == "message" for i in listed.data) and not listed.has_more
    assert [i.content[0].type for i in listed.data] == ["input_text", "output_text", "input_text"]
    paged = list(client.responses.input_items.list(out.id, limit=1, order="asc"))     # the SDK follows `after`
    assert [i.id for i in paged] == [i.id for i in reversed(listed.data)]

    client.responses.delete(out.id)
    with pytest.raises(openai.NotFoundError, match="responses_store"):
        client.responses.retrieve(out.id)
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model="tiny", previous_response_id=out.id, input="x", max_output_tokens=1)
    assert e.value.body["param"] == "previous_response_id"
    unkept = client.responses.create(model="tiny", input="hi", max_output_tokens=1, store=False)
    assert unkept.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.input_items.list(unkept.id)


@pytest.mark.parametrize("method,path,param", [
    ("GET", "/v1/responses/{}?stream=true", "stream"),
    ("POST", "/v1/responses/{}/cancel", None),
    ("GET", "/v1/responses/{}/input_items?limit=0", "limit"),
    ("GET", "/v1/responses/{}/input_items?after=msg_x", "after"),
])
def test_kept_response_routes_refuse_what_they_cannot_do(hermes, method, path, param):
    out = _client(hermes).responses.create(model="tiny", input="hi", max_output_tokens=1)
    r = httpx.request(method, hermes.url + path.format(out.id), timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert httpx.get(hermes.url + f"/v1/responses/{out.id}").json()["id"] == out.id


def test_the_store_keeps_the_newest_and_refuses_store_when_it_keeps_none():
    store = ResponseStore(2)
    for rid in ("a", "b", "c"):
        store.put(rid, Kept({"id": rid}, [], []))
    assert store.get("c").response == {"id": "c"} and store.get("b")
    with pytest.raises(APIError) as e:
        store.get("a", "previous_response_id")
    assert e.value.status == 404 and "last 2" in e.value.message and e.value.param == "previous_response_id"
    assert [store.storing(s) for s in (None, True, False)] == [True, True, False]
    off = ResponseStore(0)
    assert off.storing(None) is False and off.storing(False) is False
    with pytest.raises(APIError, match="--responses-store"):
        off.storing(True)
