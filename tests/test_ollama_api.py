"""Ollama's API through the official `ollama` client against a real `pagedserve serve` process on a
tiny random model (a Hermes chat template, FIM tokens): /api/chat and /api/generate give what the
OpenAI routes give for the same request, streamed or not; `format` constrains the reply; the model
routes describe the served model; errors take Ollama's shape and leave the server serving. Tool calls
on the way out are checked on the wire format itself (a random model calls no tool unasked, and
Ollama's API has no way to make it)."""
from __future__ import annotations

import json

import httpx
import jsonschema
import ollama
import pytest

from chat_templates import HERMES, chat_model
from engine.output import Delta
from engine.request import FinishReason
from server.chat_output import ChatOutput
from server.ollama_format import ChatFormat
from server.tool_parsers import PARSERS
from server_process import ServerProcess
from test_fim import PREFIX, SUFFIX, fim_checkpoint

NAME = "tiny-ollama"
ASK = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the weather in Paris?"}]
GREEDY = {"temperature": 0}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_checkpoint):
    chat = chat_model(tmp_path_factory, tiny_checkpoint, "tiny-chat", HERMES)
    model = fim_checkpoint(chat, tmp_path_factory.mktemp("models") / "tiny-ollama-fim")
    with ServerProcess(model, "--served-model-name", NAME, max_model_len=1024, kv_pool_tokens=16384) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server) -> ollama.Client:
    return ollama.Client(host=server.url, timeout=120)


def openai(server, route: str, body: dict) -> dict:
    r = httpx.post(server.url + route, json={"model": NAME} | body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_chat_whole_and_streamed_give_the_openai_routes_reply_and_counts(server, client):
    whole = client.chat(model=f"{NAME}:latest", messages=ASK, options=GREEDY | {"num_predict": 12})
    chunks = list(client.chat(model=NAME, messages=ASK, options=GREEDY | {"num_predict": 12}, stream=True))
    same = openai(server, "/v1/chat/completions", {"messages": ASK, "max_tokens": 12} | GREEDY)
    text = same["choices"][0]["message"]["content"]
    assert whole.message.role == "assistant" and whole.message.content == text and text
    assert "".join(c.message.content for c in chunks) == text
    assert [c.done for c in chunks] == [False] * (len(chunks) - 1) + [True]
    last = chunks[-1]
    for done in (whole, last):
        assert done.done_reason == "length" and done.eval_count == 12
        assert done.prompt_eval_count == same["usage"]["prompt_tokens"]
        # durations in ns: the prompt's (until the first token) and the reply's fall within the whole
        assert done.total_duration >= done.prompt_eval_duration + done.eval_duration > 0
    stop = text[3:6]
    stopped = client.chat(model=NAME, messages=ASK, options=GREEDY | {"num_predict": 40, "stop": [stop]})
    assert len(stop) == 3 and stopped.done_reason == "stop" and stopped.message.content == text[:text.index(stop)]


def test_generate_follows_the_template_raw_prompts_and_fill_in_the_middle(server, client):
    kw = dict(model=NAME, options=GREEDY | {"num_predict": 8})
    templated = client.generate(prompt=ASK[1]["content"], system=ASK[0]["content"], **kw)
    chat = openai(server, "/v1/chat/completions", {"messages": ASK, "max_tokens": 8} | GREEDY)
    assert templated.response == chat["choices"][0]["message"]["content"]
    raw = client.generate(prompt="The quick brown", raw=True, **kw)
    assert raw.response == openai(server, "/v1/completions", {"prompt": "The quick brown", "max_tokens": 8}
                                  | GREEDY)["choices"][0]["text"]
    fim = "".join(c.response for c in client.generate(prompt=PREFIX, suffix=SUFFIX, stream=True, **kw))
    same = openai(server, "/v1/completions", {"prompt": PREFIX, "suffix": SUFFIX, "max_tokens": 8} | GREEDY)
    assert fim == same["choices"][0]["text"]
    loaded = client.generate(model=NAME)     # no prompt: Ollama's request to load the model
    assert loaded.done and loaded.done_reason == "load" and loaded.response == ""


def test_format_makes_the_reply_json_of_the_schema(client):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                               "days": {"type": "integer", "minimum": 1, "maximum": 7}},
              "required": ["city", "days"], "additionalProperties": False}
    reply = client.chat(model=NAME, messages=ASK, format=schema, options={"temperature": 0.8, "seed": 3,
                                                                         "num_predict": 200})
    jsonschema.validate(json.loads(reply.message.content), schema)
    # any object: a random model may write keys until num_predict ends it, so only its start is certain
    anything = client.generate(model=NAME, prompt="A JSON object:", format="json", options={"seed": 1, "num_predict": 20})
    assert anything.response.startswith("{")


def test_a_tool_round_trip_renders_as_on_the_openai_route(server, client):
    call = {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    turn = ASK + [{"role": "assistant", "content": "", "tool_calls": [call]},
                  {"role": "tool", "content": "sunny, 21 C", "tool_name": "get_weather"}]
    answer = client.chat(model=NAME, messages=turn, tools=[WEATHER], options=GREEDY | {"num_predict": 6})
    same = openai(server, "/v1/chat/completions", {"max_tokens": 6, "tools": [WEATHER], "messages": ASK + [
        {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]} | GREEDY)
    assert answer.prompt_eval_count == same["usage"]["prompt_tokens"] > 0
    assert answer.message.content == same["choices"][0]["message"]["content"]


def test_tool_calls_leave_as_whole_objects_before_the_last_line():
    reply = 'Let me look.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    counts = dict(prompt_tokens=30, completion_tokens=20)
    streamed = ChatFormat("id", NAME, None, ChatOutput(None, PARSERS["hermes"]([WEATHER])))
    pieces = [reply[i:i + 7] for i in range(0, len(reply), 7)]
    lines = [json.loads(line) for i, piece in enumerate(pieces) for line in streamed.events(0, Delta(
        text=piece, finish_reason=FinishReason.STOP if i == len(pieces) - 1 else None, **counts))]
    call = {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    assert "".join(line["message"]["content"] for line in lines) == "Let me look."
    assert [line["message"].get("tool_calls") for line in lines[-2:]] == [[call], None]
    assert [line["done"] for line in lines[-2:]] == [False, True] and lines[-1]["done_reason"] == "stop"
    whole = ChatFormat("id", NAME, None, ChatOutput(None, PARSERS["hermes"]([WEATHER]))).whole(
        [Delta(text=reply, finish_reason=FinishReason.STOP, **counts)])
    assert whole["message"] == {"role": "assistant", "content": "Let me look.", "tool_calls": [call]}
    assert (whole["done"], whole["prompt_eval_count"], whole["eval_count"]) == (True, 30, 20)


def test_the_model_routes_describe_the_served_model(server, client):
    (listed,) = client.list().models
    assert listed.model == f"{NAME}:latest" and listed.size > 0 and listed.details.family == "qwen3"
    shown = client.show(NAME)
    assert {"completion", "tools", "insert"} <= set(shown.capabilities)
    assert shown.modelinfo["qwen3.context_length"] == 1024 and "<|im_start|>" in shown.template
    (running,) = client.ps().models
    assert running.model == f"{NAME}:latest" and running.context_length == 1024
    assert httpx.get(server.url + "/api/version").json()["version"]


@pytest.mark.parametrize("route, body, status, words", [
    ("/api/chat", {"model": "llama3", "messages": ASK}, 404, "model 'llama3' is not served"),
    ("/api/chat", {"model": NAME, "messages": ASK, "options": {"mirostat": 2}}, 400, "options.mirostat"),
    ("/api/chat", {"model": NAME, "messages": [{"role": "user", "content": "hi", "images": ["aGk="]}]}, 400,
     "messages.0.images"),
    ("/api/generate", {"model": NAME, "prompt": "hi", "context": [1, 2]}, 400, "context"),
    ("/api/chat", {"model": NAME, "messages": ASK, "options": {"temperature": -1}}, 400, "options.temperature"),
    ("/api/chat", {"model": NAME, "messages": []}, 400, "messages"),
    ("/api/pull", {"model": "llama3"}, 501, "pagedserve pull"),
    ("/api/embed", {"model": NAME, "input": "hi"}, 501, "embedding"),
])
def test_errors_take_ollamas_shape_and_the_server_keeps_serving(server, client, route, body, status, words):
    # as Ollama's own curl examples send it: JSON with no content type
    r = httpx.post(server.url + route, content=json.dumps(body), timeout=60)
    assert r.status_code == status and list(r.json()) == ["error"] and words in r.json()["error"], r.text
    if route == "/api/chat":
        with pytest.raises(ollama.ResponseError) as caught:
            client.chat(**body)
        assert caught.value.status_code == status and words in caught.value.error
    ok = client.chat(model=NAME, messages=ASK, options={"num_predict": 2}, stream=False)
    assert ok.done and ok.eval_count == 2
