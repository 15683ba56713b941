"""OpenAI's Responses API (POST /v1/responses) through the official `openai` client against real
`pagedserve serve` processes on tiny random models: text whole and streamed (the same answer, the
documented event order), function calls forced by constrained decoding and their round trip,
structured output from `text.format`, reasoning items, the token limit, 400s naming the param, and
(on the format alone) how a failed or cancelled stream ends. Kept responses: test_responses_store.py."""
from __future__ import annotations

import json
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest

from engine.output import Delta
from engine.request import FinishReason
from server.chat_output import ChatOutput
from server.errors import APIError
from server.responses_format import ResponsesFormat

from chat_templates import HERMES, XML_THINKING, assert_refused, chat_server, tag_id

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
CLOCK = {"type": "object", "properties": {"zone": {"enum": ["utc", "cet", "pst"]}},
         "required": ["zone"], "additionalProperties": False}
TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather in a city", "parameters": WEATHER},
         {"type": "function", "name": "get_time", "description": "The time in a zone", "parameters": CLOCK}]
SCHEMAS = {t["name"]: t["parameters"] for t in TOOLS}
ASK = "What is the weather in Paris for the next 3 days?"
GENERATION = {"top_k": 1, "repetition_penalty": 1.0}       # top_k 1: leaving sampling out = greedy


@pytest.fixture(scope="module")
def hermes(tmp_path_factory, tiny_checkpoint):
    with chat_server(tmp_path_factory, tiny_checkpoint, "tiny-hermes", HERMES, "--served-model-name", "tiny",
                     generation=GENERATION) as srv:
        yield srv


@pytest.fixture(scope="module")
def thinking(tmp_path_factory, tiny_checkpoint):
    with chat_server(tmp_path_factory, tiny_checkpoint, "tiny-xml", XML_THINKING, generation=GENERATION) as srv:
        yield srv


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


def _events(client, **kw) -> list:
    return list(client.responses.create(**kw, stream=True))


def _calls(response) -> list[tuple[str, str]]:
    return [(item.name, item.arguments) for item in response.output if item.type == "function_call"]


def _check_sequence(events) -> None:
    """Numbered from 0 without gaps; every item added before its deltas and done after them."""
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[-1].type in ("response.completed", "response.incomplete")
    opened, closed = set(), set()
    for e in events[2:-1]:
        index = e.output_index
        if e.type == "response.output_item.added":
            assert index not in opened
            opened.add(index)
        else:
            assert index in opened and index not in closed, e.type
        if e.type == "response.output_item.done":
            closed.add(index)
    assert opened == closed == set(range(len(events[-1].response.output)))


# ---- text -----------------------------------------------------------------------------------------
def test_text_whole_and_streamed_are_the_same_answer(hermes):
    client = _client(hermes)
    kw = dict(model="tiny", input=ASK, instructions="Answer briefly.", temperature=0, max_output_tokens=24,
              metadata={"ticket": "42"}, store=False, include=["reasoning.encrypted_content"],
              reasoning={"effort": "low"})          # what Codex CLI sends besides: accepted, ignored
    whole = client.responses.create(**kw)
    assert whole.id.startswith("resp_") and whole.object == "response" and whole.model == "tiny"
    assert whole.status in ("completed", "incomplete") and whole.output_text
    (message,) = whole.output
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert message.content[0].type == "output_text" and message.content[0].annotations == []
    assert whole.instructions == "Answer briefly." and whole.metadata == {"ticket": "42"}
    assert whole.temperature == 0 and whole.max_output_tokens == 24 and whole.tool_choice == "auto"
    assert whole.text.format.type == "text" and whole.tools == [] and whole.parallel_tool_calls
    usage = whole.usage
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens and usage.output_tokens <= 24
    assert usage.output_tokens_details.reasoning_tokens == 0

    events = _events(client, **kw)
    _check_sequence(events)
    assert [e.type for e in events[2:4]] == ["response.output_item.added", "response.content_part.added"]
    assert [e.type for e in events[-4:-1]] == ["response.output_text.done", "response.content_part.done",
                                               "response.output_item.done"]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    done = next(e for e in events if e.type == "response.output_text.done")
    final = events[-1].response
    assert "".join(deltas) == done.text == final.output_text == whole.output_text
    assert final.status == whole.status and final.usage.output_tokens == usage.output_tokens
    # the stream repeats the prompt: all of it but its last block (16 tokens) comes from the prefix cache
    cached = final.usage.input_tokens_details.cached_tokens
    assert cached == (usage.input_tokens - 1) // 16 * 16 > usage.input_tokens_details.cached_tokens
    assert final.output[0].id == events[2].item.id


def test_each_sse_event_is_named_as_its_type(hermes):
    body = {"model": "tiny", "input": [{"role": "user", "content": "hi"}], "max_output_tokens": 4,
            "stream": True}
    with httpx.stream("POST", hermes.url + "/v1/responses", json=body, timeout=60) as r:
        lines = [line for line in r.iter_lines() if line]
    names = [line.removeprefix("event: ") for line in lines if line.startswith("event: ")]
    types = [json.loads(line.removeprefix("data: "))["type"] for line in lines if line.startswith("data: ")]
    assert names == types and types[0] == "response.created" and "[DONE]" not in lines[-1]


def test_the_token_limit_makes_the_response_incomplete(hermes):
    client = _client(hermes)
    kw = dict(model="tiny", input=ASK, max_output_tokens=3, extra_body={"ignore_eos": True})
    out = client.responses.create(**kw)
    assert out.status == "incomplete" and out.incomplete_details.reason == "max_output_tokens"
    assert out.usage.output_tokens == 3 and out.output[-1].status == "incomplete"
    events = _events(client, **kw)
    assert events[-1].type == "response.incomplete" and events[-1].response.output_text == out.output_text
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"


# ---- tools ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("choice", ["required", {"type": "function", "name": "get_time"}])
def test_forced_function_calls_whole_and_streamed(hermes, choice):
    client = _client(hermes)
    kw = dict(model="tiny", input=ASK, tools=TOOLS, tool_choice=choice, temperature=0, max_output_tokens=200,
              parallel_tool_calls=False)
    whole = client.responses.create(**kw)
    assert whole.status == "completed"
    (call,) = whole.output
    assert call.type == "function_call" and call.status == "completed"
    assert call.id.startswith("fc_") and call.call_id.startswith("call_")
    assert call.name == "get_time" if isinstance(choice, dict) else call.name in SCHEMAS
    jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    assert whole.tool_choice == choice if isinstance(choice, str) else whole.tool_choice.name == "get_time"
    assert [t.name for t in whole.tools] == ["get_weather", "get_time"]

    with client.responses.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert _calls(final) == _calls(whole)
    _check_sequence(events)
    arguments = [e for e in events if e.type.startswith("response.function_call_arguments")]
    assert "".join(e.delta for e in arguments[:-1]) == arguments[-1].arguments == call.arguments
    assert not any(e.type.startswith("response.output_text") for e in events)


def _forced(server, text: str, calls: list[dict]) -> str:
    """A Lark grammar that makes the model write `text`, then each call as a <tool_call> block."""
    model = Path(server.proc.args[server.proc.args.index("--model") + 1])
    open_, close = (f"<[{tag_id(model, t)}]>" for t in ("<tool_call>", "</tool_call>"))
    bodies = [json.dumps("\n" + json.dumps(c) + "\n") for c in calls]
    blocks = [f"{open_} {body} {close}" for body in bodies]
    return f"start: {json.dumps(text)} " + ' "\\n" '.join(blocks)


def test_text_and_parallel_calls_are_items_of_their_own(hermes):
    client = _client(hermes)
    calls = [{"name": "get_weather", "arguments": {"city": "Zürich", "days": 2}},
             {"name": "get_time", "arguments": {"zone": "cet"}}]
    kw = dict(model="tiny", input=ASK, tools=TOOLS, temperature=0, max_output_tokens=200,
              extra_body={"guided_grammar": _forced(hermes, "Let me check.\n", calls)})
    whole = client.responses.create(**kw)
    assert [item.type for item in whole.output] == ["message", "function_call", "function_call"]
    assert whole.output_text == "Let me check." and whole.status == "completed"
    assert [(n, json.loads(a)) for n, a in _calls(whole)] == [(c["name"], c["arguments"]) for c in calls]
    assert len({item.call_id for item in whole.output[1:]}) == 2
    events = _events(client, **kw)
    _check_sequence(events)
    final = events[-1].response
    assert [item.type for item in final.output] == [item.type for item in whole.output]
    assert final.output_text == whole.output_text and _calls(final) == _calls(whole)
    done = [e.arguments for e in events if e.type == "response.function_call_arguments.done"]
    assert done == [a for _, a in _calls(whole)]


def test_a_function_call_round_trip(hermes):
    client = _client(hermes)
    ask = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": ASK}]}]
    first = client.responses.create(model="tiny", input=ask, tools=TOOLS, tool_choice="required", temperature=0,
                                    max_output_tokens=200, parallel_tool_calls=False)
    (call,) = first.output
    result = [{"type": "function_call_output", "call_id": call.call_id,
               "output": [{"type": "input_text", "text": "sunny, 21 C"}]}]
    second = client.responses.create(model="tiny", input=ask + [call.model_dump(exclude_none=True)] + result,
                                     tools=TOOLS, temperature=0, max_output_tokens=5)
    assert second.status in ("completed", "incomplete") and second.output
    # the same conversation through chat completions: the same prompt, so the items reached the template
    chat_tools = [{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}} for t in TOOLS]
    messages = [{"role": "user", "content": ASK},
                {"role": "assistant", "content": None,
                 "tool_calls": [{"id": call.call_id, "type": "function",
                                 "function": {"name": call.name, "arguments": call.arguments}}]},
                {"role": "tool", "tool_call_id": call.call_id, "content": "sunny, 21 C"}]
    chat = client.chat.completions.create(model="tiny", max_tokens=1, tools=chat_tools, messages=messages)
    assert second.usage.input_tokens == chat.usage.prompt_tokens > first.usage.input_tokens


# ---- structured output, reasoning -----------------------------------------------------------------
def test_text_format_json_schema_constrains_the_answer(hermes):
    client = _client(hermes)
    kw = dict(model="tiny", input=ASK, temperature=0, max_output_tokens=300,
              text={"format": {"type": "json_schema", "name": "weather", "schema": WEATHER, "strict": True}})
    whole = client.responses.create(**kw)
    assert whole.status == "completed" and whole.text.format.type == "json_schema"
    jsonschema.validate(json.loads(whole.output_text), WEATHER)
    with client.responses.stream(**kw) as stream:
        final = stream.get_final_response()
    assert final.output_text == whole.output_text


def _think_end(server) -> dict:
    """A bias that makes the random model close its reasoning after a few tokens."""
    model = Path(server.proc.args[server.proc.args.index("--model") + 1])
    return {str(tag_id(model, "</think>")): 4}


def test_reasoning_comes_as_a_reasoning_item(thinking):
    client = _client(thinking)
    kw = dict(model="tiny-xml", input=ASK, temperature=1.0, max_output_tokens=40,
              extra_body={"logit_bias": _think_end(thinking), "seed": 1, "top_k": 0})
    whole = client.responses.create(**kw)
    reasoning, message = whole.output
    assert reasoning.type == "reasoning" and reasoning.id.startswith("rs_") and reasoning.summary == []
    assert reasoning.content[0].type == "reasoning_text" and reasoning.content[0].text
    assert reasoning.status == "completed" and message.status == "incomplete"     # the limit cut the answer
    assert "</think>" not in reasoning.content[0].text        # split off where the model closed it
    assert 0 < whole.usage.output_tokens_details.reasoning_tokens < whole.usage.output_tokens == 40
    events = _events(client, **kw)
    _check_sequence(events)
    thought = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert thought == reasoning.content[0].text
    assert events[-1].response.output_text == whole.output_text


def test_namespaced_functions_are_called_and_hosted_tools_not_offered(hermes):
    # as Codex CLI sends its tools: functions in a namespace, and web_search, which this server cannot run
    tools = [{"type": "web_search", "external_web_access": False},
             {"type": "namespace", "name": "weather", "description": "Weather tools", "tools": TOOLS[:1]}]
    client = _client(hermes)
    out = client.responses.create(model="tiny", input=ASK, tools=tools, tool_choice="required",
                                  parallel_tool_calls=False, max_output_tokens=200)
    (call,) = [item for item in out.output if item.type == "function_call"]
    assert (call.name, call.namespace) == ("get_weather", "weather")
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    streamed = [e.item for e in _events(client, model="tiny", input=ASK, tools=tools, tool_choice="required",
                                        parallel_tool_calls=False, max_output_tokens=200)
                if e.type == "response.output_item.done"]
    assert [(i.name, i.namespace, i.arguments) for i in streamed] == [(call.name, call.namespace, call.arguments)]
    # the call goes back in with its namespace: the model reads it under the name it called
    turn = [{"role": "user", "content": ASK}, call.model_dump(exclude_none=True, exclude={"id", "status"}),
            {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}]
    flat = {"type": "function", **{k: v for k, v in TOOLS[0].items() if k != "type"}, "name": "weather.get_weather"}
    flat_call = turn[1] | {"name": "weather.get_weather"}
    flat_call.pop("namespace")
    answers = [client.responses.create(model="tiny", input=history, tools=offered, max_output_tokens=1)
               for history, offered in ((turn, tools), ([turn[0], flat_call, turn[2]], [flat]))]
    assert answers[0].usage.input_tokens == answers[1].usage.input_tokens


# ---- refusals -------------------------------------------------------------------------------------
BAD = [
    ({"conversation": "conv_1"}, "conversation", "previous_response_id"),
    ({"tools": [{"type": "namespace", "name": "n", "tools": [{"type": "web_search"}]}]}, "tools.0.tools.0.type",
     "'web_search'"),
    ({"tools": TOOLS[:1] + [{"type": "namespace", "name": "n", "tools": [
        {"type": "function", "name": "f", "parameters": {"type": "objekt"}}]}]}, "tools.1.tools.0.parameters", "objekt"),
    ({"tools": [{"type": "function", "name": "f", "parameters": {"type": "objekt"}}]}, "tools.0.parameters",
     "objekt"),
    ({"tool_choice": {"type": "file_search"}, "tools": TOOLS}, "tool_choice.type", "'file_search'"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input.0.type", "'item_reference'"),
    ({"input": [{"type": "function_call_output", "call_id": "call_1", "output": "x"}]}, "input.0.call_id",
     "call_1"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input.0.content.0.type", "input_image"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema", "needs a schema"),
]


@pytest.mark.parametrize("extra,param,words", BAD, ids=[b[1] for b in BAD])
def test_refusals_are_400s_naming_the_param(hermes, extra, param, words):
    assert_refused(hermes, "/v1/responses", {"model": "tiny", "input": ASK, "max_output_tokens": 2} | extra,
                   param, words)


# ---- the stream's endings the engine rarely gives (the format alone) ------------------------------
def _sse(chunks: list[bytes]) -> list[tuple[str, dict]]:
    """(event name, data) of each server-sent event in `chunks`."""
    out = []
    for block in b"".join(chunks).decode().strip().split("\n\n"):
        name, data = block.split("\n")
        out.append((name.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return out


def test_a_failed_or_cancelled_stream_says_so_in_order():
    failing = ResponsesFormat("resp_1", "tiny", None, ChatOutput(), {})
    chunks = failing.opening() + failing.events(0, Delta(text="Hel"))
    chunks.append(failing.error_event(APIError(500, "the engine failed this request: boom", code="engine_error")))
    events = _sse(chunks + failing.closing([Delta(finish_reason=FinishReason.ERROR)], False))
    assert [d["sequence_number"] for _, d in events] == list(range(len(events)))
    assert [name for name, _ in events][-2:] == ["error", "response.failed"]
    assert events[-2][1]["code"] == "engine_error" and "boom" in events[-2][1]["message"]
    assert events[-1][1]["response"]["status"] == "failed"

    cancelled = ResponsesFormat("resp_2", "tiny", None, ChatOutput(), {})
    chunks = cancelled.opening() + cancelled.events(0, Delta(text="Hi"))
    events = _sse(chunks + cancelled.closing([Delta(finish_reason=FinishReason.CANCELLED)], False))
    name, data = events[-1]
    assert name == "response.failed" and data["response"]["status"] == "cancelled"
    assert data["response"]["output"][0]["status"] == "incomplete"
    assert data["response"]["output"][0]["content"][0]["text"] == "Hi"
