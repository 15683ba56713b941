"""Anthropic's Messages API through the official `anthropic` client against real `pagedserve serve`
processes on tiny random models: plain and streamed messages, a forced and validated tool round
trip, stop sequences, count_tokens, thinking blocks, Anthropic's error shapes, a disconnect that
frees everything; and, on any route, CORS and the request time limit."""
from __future__ import annotations

import json
import re
import time

import anthropic
import httpx
import jsonschema
import pytest

from chat_templates import HERMES, XML_THINKING, chat_model
from server_process import ServerProcess

KEY = "sk-anthropic-test"
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"name": "get_weather", "description": "Weather in a city", "input_schema": WEATHER},
         {"name": "get_time", "description": "The time", "input_schema": {
             "type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"]}}]
ASK = [{"role": "user", "content": "What is the weather in Paris for 3 days?"}]
GREEDY = {"temperature": 0}     # the current SDK has no sampling arguments; the API still takes them


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_checkpoint):
    with ServerProcess(chat_model(tmp_path_factory, tiny_checkpoint, "tiny-claude", HERMES), "--api-key", KEY,
                       "--max-concurrency", "4", max_model_len=1024, kv_pool_tokens=16384) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=120)


def _tool_uses(message) -> list:
    return [b for b in message.content if b.type == "tool_use"]


def test_plain_and_streamed_messages_agree(client):
    kw = dict(model="tiny-claude", max_tokens=24, messages=ASK, system="Be brief.", extra_body=GREEDY)
    whole = client.messages.create(**kw)
    assert whole.type == "message" and whole.role == "assistant" and whole.id.startswith("msg_")
    assert whole.stop_reason == "max_tokens" and whole.usage.output_tokens == 24
    assert [b.type for b in whole.content] == ["text"] and whole.content[0].text
    with client.messages.stream(**kw) as stream:
        events = [event.type for event in stream]
        final = stream.get_final_message()
    assert final.content[0].text == whole.content[0].text and final.stop_reason == "max_tokens"
    # the stream repeats the prompt: all of it but its last block comes from the prefix cache, which
    # Anthropic's usage counts apart from input_tokens
    prompt = whole.usage.input_tokens + whole.usage.cache_read_input_tokens
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == prompt
    assert final.usage.cache_read_input_tokens == (prompt - 1) // 16 * 16 > whole.usage.cache_read_input_tokens
    assert whole.usage.cache_creation_input_tokens == final.usage.cache_creation_input_tokens == 0
    assert events[0] == "message_start" and events[-1] == "message_stop"
    assert {"content_block_start", "content_block_delta", "content_block_stop", "message_delta"} <= set(events)


def test_a_forced_tool_call_round_trip(client):
    kw = dict(model="tiny-claude", max_tokens=200, tools=TOOLS, extra_body=GREEDY)
    first = client.messages.create(**kw, messages=ASK, tool_choice={"type": "any", "disable_parallel_tool_use": True})
    (use,) = _tool_uses(first)
    assert first.stop_reason == "tool_use" and use.id.startswith("toolu_") and use.name in ("get_weather", "get_time")
    jsonschema.validate(use.input, next(t["input_schema"] for t in TOOLS if t["name"] == use.name))
    with client.messages.stream(**kw, messages=ASK,
                                tool_choice={"type": "any", "disable_parallel_tool_use": True}) as stream:
        streamed = stream.get_final_message()
    assert [(b.name, b.input) for b in _tool_uses(streamed)] == [(use.name, use.input)]
    named = client.messages.create(**kw, messages=ASK, tool_choice={"type": "tool", "name": "get_time"})
    assert {b.name for b in _tool_uses(named)} == {"get_time"}
    turn = ASK + [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                "content": [{"type": "text", "text": "sunny, 21 C"}]}]}]
    answer = client.messages.create(model="tiny-claude", max_tokens=8, tools=TOOLS, messages=turn, extra_body=GREEDY)
    assert answer.stop_reason in ("end_turn", "max_tokens", "tool_use")
    counted = client.messages.count_tokens(model="tiny-claude", tools=TOOLS, messages=turn).input_tokens
    prompt = [u.input_tokens + u.cache_read_input_tokens for u in (answer.usage, first.usage)]
    assert counted == prompt[0] > prompt[1] and answer.usage.cache_read_input_tokens > 0


def test_stop_sequences_end_the_reply_and_say_which(client):
    kw = dict(model="tiny-claude", max_tokens=40, messages=ASK, extra_body=GREEDY)
    text = client.messages.create(**kw).content[0].text
    stop = text[10:13]
    cut = client.messages.create(**kw, stop_sequences=["never-there", stop])
    assert (cut.stop_reason, cut.stop_sequence) == ("stop_sequence", stop)
    assert cut.content[0].text == text[:text.index(stop)]


def test_a_system_message_mid_conversation_is_a_system_turn(client, server):
    # as Claude Code sends them: an instruction between the turns, rendered where it stands
    turn = ASK + [{"role": "assistant", "content": "Which units?"}, {"role": "system", "content": "Use Celsius."},
                  {"role": "user", "content": "Celsius, please."}]
    message = client.messages.create(model="tiny-claude", max_tokens=8, messages=turn, extra_body=GREEDY)
    chat = httpx.post(server.url + "/v1/chat/completions", headers={"x-api-key": KEY}, json={
        "messages": turn, "max_tokens": 8} | GREEDY).json()
    assert message.content[0].text == chat["choices"][0]["message"]["content"]
    counted = client.messages.count_tokens(model="tiny-claude", messages=turn).input_tokens
    assert counted == chat["usage"]["prompt_tokens"]


def test_claude_codes_billing_line_is_left_out_of_the_prompt(client):
    # Claude Code's first system block changes with every request; the prompt is the rest, and the
    # prefix cache serves all of it but the last block
    system = [{"type": "text", "text": "Be brief and exact. " * 12}]
    kw = dict(model="tiny-claude", max_tokens=4, messages=ASK, extra_body=GREEDY)
    plain = client.messages.create(**kw, system=system)
    prompt = plain.usage.input_tokens + plain.usage.cache_read_input_tokens
    for nonce in ("3a9", "7c1"):
        billing = {"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.1.197.{nonce}; cc_entrypoint=cli;"}
        billed = client.messages.create(**kw, system=[billing] + system)
        assert billed.content[0].text == plain.content[0].text
        assert billed.usage.input_tokens + billed.usage.cache_read_input_tokens == prompt
        assert billed.usage.cache_read_input_tokens == (prompt - 1) // 16 * 16


def test_a_new_system_text_reuses_the_cached_tools(client):
    """Tools render before the system text (Anthropic's cache order, which Claude Code builds on: its system
    text names the project, its tools do not), so a request whose system text differs reads the tools from
    the prefix cache."""
    kw = dict(model="tiny-claude", max_tokens=2, tools=TOOLS, messages=ASK, extra_body=GREEDY)
    tools = client.messages.count_tokens(model="tiny-claude", tools=TOOLS, messages=ASK).input_tokens
    bare = client.messages.count_tokens(model="tiny-claude", messages=ASK).input_tokens
    client.messages.create(**kw, system="The project is /work/alpha.")
    other = client.messages.create(**kw, system="The project is /work/beta, a git repository.")
    assert other.usage.cache_read_input_tokens >= (tools - bare) // 16 * 16 > 0


class _Template:
    """A tokenizer's chat-template side, as server/tools.py's probes use it."""

    def __init__(self, source: str) -> None:
        import jinja2

        def refuse(message):
            raise ValueError(message)
        self.chat_template = source
        self._template = jinja2.Environment().from_string(source, globals={"raise_exception": refuse})

    def apply_chat_template(self, messages, tools=None, **kwargs) -> str:
        return self._template.render(messages=messages, tools=tools, add_generation_prompt=True, **kwargs)


def test_tools_go_first_only_where_the_template_takes_a_second_system_message():
    from server.tools import renders_tools_first
    refusing = ("{%- for m in messages %}{%- if m.role == 'system' and not loop.first %}"
                "{{- raise_exception('System message must be at the beginning.') }}{%- endif %}{%- endfor %}" + HERMES)
    assert renders_tools_first(_Template(HERMES))
    assert not renders_tools_first(_Template(refusing))
    assert not renders_tools_first(_Template("{%- for m in messages %}{{- m.content }}{%- endfor %}"))   # no tools


def test_the_models_list_and_retrieve_in_anthropics_shape(client):
    assert [(m.id, m.type, m.display_name) for m in client.models.list()] == [("tiny-claude", "model", "tiny-claude")]
    assert client.models.retrieve("tiny-claude").created_at.year == 1970
    with pytest.raises(anthropic.NotFoundError, match="'tiny-claude'"):
        client.models.retrieve("claude-opus-4-1")


def test_count_tokens_is_the_engines_count(client, server):
    counted = client.messages.count_tokens(model="tiny-claude", system="Be brief.", messages=ASK)
    chat = httpx.post(server.url + "/v1/chat/completions", headers={"x-api-key": KEY}, json={
        "messages": [{"role": "system", "content": "Be brief."}] + ASK, "max_tokens": 1}).json()
    assert counted.input_tokens == chat["usage"]["prompt_tokens"]


def test_structured_output_through_output_config(client):
    for seed in range(3):
        out = client.messages.create(model="tiny-claude", max_tokens=200, messages=ASK,
                                     output_config={"format": {"type": "json_schema", "schema": WEATHER}},
                                     extra_body={"temperature": 1.0, "seed": seed, "top_k": 0})
        jsonschema.validate(json.loads(out.content[0].text), WEATHER)


BAD = [
    ({"messages": ASK}, 400, "invalid_request_error", "max_tokens"),
    ({"max_tokens": 5, "messages": [{"role": "assistant", "content": "hi"}] + ASK}, 400,
     "invalid_request_error", "first message"),
    ({"max_tokens": 5, "messages": ASK, "model": "claude-opus-9"}, 404, "not_found_error", "claude-opus-9"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, 400,
     "invalid_request_error", "image"),
    ({"max_tokens": 5, "messages": ASK, "tools": [{"name": "f", "input_schema": {"type": "objekt"}}]}, 400,
     "invalid_request_error", "objekt"),
    ({"max_tokens": 5, "messages": ASK, "tools": TOOLS, "tool_choice": {"type": "tool", "name": "nope"}}, 400,
     "invalid_request_error", "nope"),
    ({"max_tokens": 5, "messages": ASK, "tools": [{"type": "bash_20250124", "name": "bash"}]}, 400,
     "invalid_request_error", "bash_20250124"),
]


@pytest.mark.parametrize("body,status,kind,words", BAD, ids=[f"{b[1]}-{i}" for i, b in enumerate(BAD)])
def test_errors_take_anthropics_shape(server, body, status, kind, words):
    r = httpx.post(server.url + "/v1/messages", headers={"x-api-key": KEY}, json={"model": "tiny-claude"} | body)
    assert r.status_code == status, r.text
    error = r.json()
    assert error["type"] == "error" and error["error"]["type"] == kind and words in error["error"]["message"]


def test_a_prompt_over_the_context_says_so_in_anthropics_words(client):
    # Claude Code's own pattern: it drops the oldest turns by the gap between the numbers and retries
    long = [{"role": "user", "content": "lorem ipsum dolor " * 400}]
    tokens = client.messages.count_tokens(model="tiny-claude", messages=long).input_tokens
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(model="tiny-claude", max_tokens=5, messages=long)
    found = re.search(r"prompt is too long[^0-9]*(\d+)\s*tokens?\s*>\s*(\d+)", caught.value.message, re.I)
    assert found and (int(found[1]), int(found[2])) == (tokens, 1023), caught.value.message
    assert "max_model_len is 1,024" in caught.value.message


def test_a_wrong_key_is_anthropics_authentication_error(server):
    bad = anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as caught:
        bad.messages.create(model="tiny-claude", max_tokens=2, messages=ASK)
    assert caught.value.body["error"]["type"] == "authentication_error"


def test_a_disconnect_mid_stream_frees_every_block(server):
    body = {"model": "tiny-claude", "max_tokens": 900, "messages": ASK, "stream": True, "temperature": 0,
            "ignore_eos": True}
    with httpx.stream("POST", server.url + "/v1/messages", headers={"x-api-key": KEY}, json=body,
                      timeout=60) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("event: ")) == "event: message_start"
        next(line for line in lines if line == "event: content_block_delta")
    deadline = time.monotonic() + 30        # a bound on the wait, not a measured speed
    while True:
        stats = httpx.get(server.url + "/v1/requests", headers={"x-api-key": KEY}).json()["stats"]
        if stats["blocks_used"] == 0 and stats["running"] == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert (stats["blocks_used"], stats["running"], stats["waiting"]) == (0, 0, 0)


# ---- thinking, CORS and the request time limit ----------------------------------------------------
@pytest.fixture(scope="module")
def limited(tmp_path_factory, tiny_checkpoint):
    """A thinking model, a browser origin allowed, and a time limit no reply can meet."""
    with ServerProcess(chat_model(tmp_path_factory, tiny_checkpoint, "tiny-think", XML_THINKING), "--api-key", KEY,
                       "--allowed-origins", "http://good.example", "--request-timeout-s", "0.001",
                       max_model_len=1024, kv_pool_tokens=16384) as srv:
        yield srv


def test_thinking_comes_back_as_thinking_blocks(tmp_path_factory, tiny_checkpoint):
    with ServerProcess(chat_model(tmp_path_factory, tiny_checkpoint, "tiny-think-2", XML_THINKING),
                       max_model_len=1024, kv_pool_tokens=16384) as srv:
        client = anthropic.Anthropic(base_url=srv.url, api_key="none", max_retries=0)
        kw = dict(model="tiny-think-2", max_tokens=16, messages=ASK, extra_body=GREEDY)
        thought = client.messages.create(**kw, thinking={"type": "enabled", "budget_tokens": 1024})
        assert [b.type for b in thought.content] == ["thinking"] and thought.content[0].thinking
        with client.messages.stream(**kw, thinking={"type": "enabled", "budget_tokens": 1024}) as stream:
            assert stream.get_final_message().content[0].thinking == thought.content[0].thinking
        plain = client.messages.create(**kw, thinking={"type": "disabled"})
        assert [b.type for b in plain.content] == ["text"]


def test_cors_preflight_for_allowed_and_refused_origins(limited):
    ask = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "content-type,x-api-key"}
    good = httpx.options(limited.url + "/v1/messages", headers=ask | {"Origin": "http://good.example"})
    assert good.status_code == 200 and good.headers["access-control-allow-origin"] == "http://good.example"
    bad = httpx.options(limited.url + "/v1/messages", headers=ask | {"Origin": "http://evil.example"})
    assert bad.status_code == 400 and "access-control-allow-origin" not in bad.headers
    keyless = httpx.get(limited.url + "/v1/models", headers={"Origin": "http://good.example"})
    assert keyless.status_code == 401           # the API key still holds, and the browser may read why
    assert keyless.headers["access-control-allow-origin"] == "http://good.example"


def timeouts(server) -> float:
    text = httpx.get(server.url + "/metrics", headers={"x-api-key": KEY}).text
    line = next((x for x in text.splitlines() if x.startswith('pagedserve:request_finished_total{finished_reason="timeout"}')), None)
    return float(line.rsplit(" ", 1)[1]) if line else 0.0


def test_the_time_limit_ends_requests_with_what_they_have_on_every_route(limited):
    auth = {"x-api-key": KEY}
    before = timeouts(limited)
    chat = httpx.post(limited.url + "/v1/chat/completions", headers=auth, timeout=60, json={
        "messages": ASK, "max_tokens": 900, "ignore_eos": True}).json()
    assert chat["choices"][0]["finish_reason"] == "length" and chat["usage"]["completion_tokens"] < 900
    message = httpx.post(limited.url + "/v1/messages", headers=auth, timeout=60, json={
        "model": "tiny-think", "messages": ASK, "max_tokens": 900, "ignore_eos": True}).json()
    assert message["stop_reason"] == "max_tokens" and message["usage"]["output_tokens"] < 900
    with httpx.stream("POST", limited.url + "/v1/completions", headers=auth, timeout=60, json={
            "prompt": "x", "max_tokens": 900, "ignore_eos": True, "stream": True}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert timeouts(limited) - before == 3
