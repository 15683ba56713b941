"""The agent-facing chat API through the official `openai` client against real `pagedserve serve`
processes on tiny random models: tool calls (forced by constrained decoding, so a random model
cannot pass by luck), structured outputs, reasoning, logit_bias, n > 1, served names, the model's
sampling defaults, and a 400 naming the param for every bad input while the server keeps serving."""
from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from chat_templates import HERMES, XML_THINKING, assert_refused, chat_server, tag_id

TAGS = ("<tool_call>", "</tool_call>", "<function=", "<parameter=", "<think>", "</think>")
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
CLOCK = {"type": "object", "properties": {"zone": {"enum": ["utc", "cet", "pst"]}},
         "required": ["zone"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "The time in a zone",
                                           "parameters": CLOCK}}]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris for the next 3 days?"}]
GENERATION = {"top_k": 1, "repetition_penalty": 1.0}       # top_k 1: leaving sampling out = greedy
SAMPLED = {"top_k": 0}          # a request that samples on the server with GENERATION's defaults


@pytest.fixture(scope="module")
def hermes(tmp_path_factory, tiny_checkpoint):
    with chat_server(tmp_path_factory, tiny_checkpoint, "tiny-hermes", HERMES, "--served-model-name", "tiny",
                     "--served-model-name", "tiny-alias", "--served-model-name", "claude-*",
                     generation=GENERATION) as srv:
        yield srv


@pytest.fixture(scope="module")
def thinking(tmp_path_factory, tiny_checkpoint):
    with chat_server(tmp_path_factory, tiny_checkpoint, "tiny-xml", XML_THINKING) as srv:
        yield srv


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


def _calls(message) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or ()]


def _stream(client, **kw):
    """The SDK's own accumulator over a stream, and every chunk it saw."""
    chunks = []
    with client.chat.completions.stream(**kw) as stream:
        for event in stream:
            if event.type == "chunk":
                chunks.append(event.chunk)
        final = stream.get_final_completion()
    return final, chunks


def _no_raw_tags(chunks) -> None:
    for chunk in chunks:
        for choice in chunk.choices:
            pieces = [choice.delta.content or "", getattr(choice.delta, "reasoning_content", None) or ""]
            pieces += [c.function.arguments or "" for c in choice.delta.tool_calls or () if c.function]
            assert not any(tag in piece for piece in pieces for tag in TAGS), pieces


# ---- tools ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_forced_tool_calls_are_parsed_whole_and_streamed(hermes, choice):
    client = _client(hermes)
    kw = dict(model="tiny", messages=ASK, tools=TOOLS, tool_choice=choice, temperature=0,
              max_tokens=200, parallel_tool_calls=False)
    whole = client.chat.completions.create(**kw)
    message, finish = whole.choices[0].message, whole.choices[0].finish_reason
    calls = _calls(message)
    assert finish == "tool_calls" and message.content is None and len(calls) == 1
    name, arguments = calls[0]
    assert name == ("get_time" if isinstance(choice, dict) else name) and name in SCHEMAS
    jsonschema.validate(arguments, SCHEMAS[name])
    assert message.tool_calls[0].id.startswith("call_") and message.tool_calls[0].type == "function"
    final, chunks = _stream(client, **kw)
    streamed = final.choices[0].message
    assert final.choices[0].finish_reason == "tool_calls" and not streamed.content
    assert [(c.function.name, c.function.arguments) for c in streamed.tool_calls] == \
        [(c.function.name, c.function.arguments) for c in message.tool_calls]
    _no_raw_tags(chunks)
    named = [tc for c in chunks for tc in c.choices[0].delta.tool_calls or () if tc.function.name]
    assert len(named) == 1 and named[0].id and named[0].index == 0      # id and name come once


def test_parallel_calls_get_their_own_indices(hermes):
    client = _client(hermes)
    seen = set()
    for seed in range(6):
        out = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice="required",
                                             temperature=1.0, seed=seed, max_tokens=400, extra_body=SAMPLED)
        calls = _calls(out.choices[0].message)
        seen.add(len(calls))
        for name, arguments in calls:
            jsonschema.validate(arguments, SCHEMAS[name])
        assert len({c.id for c in out.choices[0].message.tool_calls}) == len(calls)
    assert max(seen) > 1                                  # several calls in one reply happen


def test_a_schema_keyword_the_grammar_engine_lacks_leaves_the_tool_usable(hermes):
    # Claude Code's tools use propertyNames, which llguidance does not implement: the tool is still
    # offered, and a forced call still holds to the rest of the schema
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"],
              "additionalProperties": False, "propertyNames": {"enum": ["city"]}}
    tools = [{"type": "function", "function": {"name": "pick_city", "parameters": schema}}]
    client = _client(hermes)
    assert client.chat.completions.create(model="tiny", messages=ASK, tools=tools, max_tokens=2).choices
    forced = client.chat.completions.create(model="tiny", messages=ASK, tools=tools, tool_choice="required",
                                            parallel_tool_calls=False, temperature=0, max_tokens=200)
    (name, arguments), = _calls(forced.choices[0].message)
    assert name == "pick_city"
    jsonschema.validate(arguments, schema)


def test_tool_choice_none_hides_the_tools_and_calls_nothing(hermes):
    client = _client(hermes)
    base = dict(model="tiny", messages=ASK, temperature=0, max_tokens=4)
    with_tools = client.chat.completions.create(**base, tools=TOOLS)
    none = client.chat.completions.create(**base, tools=TOOLS, tool_choice="none")
    plain = client.chat.completions.create(**base)
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens < with_tools.usage.prompt_tokens
    assert none.choices[0].message.tool_calls is None and none.choices[0].message.content is not None


def test_a_second_turn_with_the_tool_result_reaches_the_template(hermes):
    client = _client(hermes)
    first = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice="required",
                                           temperature=0, max_tokens=200, parallel_tool_calls=False)
    call = first.choices[0].message.tool_calls[0]
    turn = ASK + [{"role": "assistant", "content": None,
                   "tool_calls": [{"id": call.id, "type": "function",
                                   "function": {"name": call.function.name,
                                                "arguments": call.function.arguments}}]},
                  {"role": "tool", "tool_call_id": call.id,
                   "content": [{"type": "text", "text": "sunny, 21 C"}]}]
    second = client.chat.completions.create(model="tiny", messages=turn, tools=TOOLS, temperature=0,
                                            max_tokens=5)
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
    ids = httpx.post(hermes.url + "/tokenize", json={"messages": turn}).json()["tokens"]
    text = httpx.post(hermes.url + "/detokenize", json={"tokens": ids}).json()["prompt"]
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in text
    # the arguments were given to the template as an object, so it wrote them as JSON once
    assert f'"arguments": {json.dumps(json.loads(call.function.arguments))}' in text


def _forced(server, text_before: str, body: str) -> str:
    """A Lark grammar that makes the model write `text_before`, a <tool_call> block around `body`."""
    model = server.proc.args[server.proc.args.index("--model") + 1]
    from pathlib import Path
    open_, close = (f"<[{tag_id(Path(model), t)}]>" for t in ("<tool_call>", "</tool_call>"))
    return f'start: {json.dumps(text_before)} {open_} {json.dumps(body)} {close}'


def test_auto_mode_parses_what_the_model_writes_and_returns_a_broken_call_as_text(hermes):
    client = _client(hermes)
    good = _forced(hermes, "Let me check.\n", '\n{"name": "get_weather", "arguments": {"city": "Zürich", "days": 2}}\n')
    kw = dict(model="tiny", messages=ASK, tools=TOOLS, temperature=0, max_tokens=100)
    whole = client.chat.completions.create(**kw, extra_body={"guided_grammar": good})
    message = whole.choices[0].message
    assert message.content == "Let me check." and whole.choices[0].finish_reason == "tool_calls"
    assert _calls(message) == [("get_weather", {"city": "Zürich", "days": 2})]
    final, chunks = _stream(client, **kw, extra_body={"guided_grammar": good})
    assert final.choices[0].message.content == "Let me check."
    assert _calls(final.choices[0].message) == _calls(message)
    _no_raw_tags(chunks)
    broken = _forced(hermes, "", '\n{name: get_weather}\n')
    out = client.chat.completions.create(**kw, extra_body={"guided_grammar": broken})
    assert out.choices[0].message.tool_calls is None and out.choices[0].finish_reason == "stop"
    assert "{name: get_weather}" in out.choices[0].message.content


def test_auto_mode_holds_each_call_the_model_opens_to_a_well_formed_call(hermes):
    """In tool_choice auto the reply is free, and a call the model opens (pushed here by logit_bias on
    the call tag, cut by `stop` at its end tag) is held by a lazy grammar to a call of an offered tool
    whose arguments validate: after the tag, a random model writes anything otherwise."""
    from pathlib import Path
    model = Path(hermes.proc.args[hermes.proc.args.index("--model") + 1])
    client = _client(hermes)
    kw = dict(model="tiny", messages=ASK, tools=TOOLS, temperature=1.0, max_tokens=200, stop=["</tool_call>"],
              logit_bias={str(tag_id(model, "<tool_call>")): 100}, extra_body=SAMPLED)
    for seed in range(4):
        whole = client.chat.completions.create(**kw, seed=seed)
        ((name, arguments),) = _calls(whole.choices[0].message)
        jsonschema.validate(arguments, SCHEMAS[name])
    final, chunks = _stream(client, **kw, seed=seed)
    assert _calls(final.choices[0].message) == _calls(whole.choices[0].message)
    _no_raw_tags(chunks)


# ---- structured outputs, logit_bias, n ------------------------------------------------------------
def test_response_formats_and_vllm_style_constraints(hermes):
    client = _client(hermes)
    kw = dict(model="tiny", messages=ASK, temperature=1.0, max_tokens=300, extra_body=SAMPLED)
    # any object: keys are free strings, which a random model ends only when pushed to
    ends = httpx.post(hermes.url + "/tokenize", json={"prompt": '"}'}).json()["tokens"]
    for seed in range(5):
        out = client.chat.completions.create(**kw, seed=seed, response_format={
            "type": "json_schema", "json_schema": {"name": "weather", "schema": WEATHER, "strict": True}})
        jsonschema.validate(json.loads(out.choices[0].message.content), WEATHER)
        obj = client.chat.completions.create(**kw, seed=seed, response_format={"type": "json_object"},
                                             logit_bias={str(t): 6 for t in ends})
        assert isinstance(json.loads(obj.choices[0].message.content), dict)
    choice = client.chat.completions.create(**(kw | {"extra_body": SAMPLED | {"guided_choice": ["alpha", "beta"]}}))
    regex = client.completions.create(model="tiny", prompt="code:", max_tokens=50,
                                      extra_body={"structured_outputs": {"regex": "[A-Z]{2}[0-9]{3}"}})
    assert choice.choices[0].message.content in ("alpha", "beta")
    text = regex.choices[0].text
    assert len(text) == 5 and text[:2].isupper() and text[2:].isdigit()


def test_logit_bias_reaches_the_draw(hermes):
    client = _client(hermes)
    out = client.completions.create(model="tiny", prompt="x", max_tokens=6, temperature=0, logprobs=0,
                                    logit_bias={"42": 100}, extra_body={"ignore_eos": True})
    ids = httpx.post(hermes.url + "/tokenize", json={"prompt": out.choices[0].text}).json()["tokens"]
    assert set(ids) == {42}


def test_n_choices_are_seeded_apart_and_count_the_prompt_once(hermes):
    client = _client(hermes)
    kw = dict(model="tiny", messages=ASK, temperature=1.0, max_tokens=12, extra_body=SAMPLED)
    three = client.chat.completions.create(**kw, n=3, seed=11)
    alone = [client.chat.completions.create(**kw, seed=11 + i).choices[0].message.content for i in range(3)]
    assert [c.index for c in three.choices] == [0, 1, 2]
    assert [c.message.content for c in three.choices] == alone
    one = client.chat.completions.create(**kw, seed=11)
    assert three.usage.prompt_tokens == one.usage.prompt_tokens
    assert three.usage.completion_tokens == sum(
        client.chat.completions.create(**kw, seed=11 + i).usage.completion_tokens for i in range(3))
    stream = list(client.chat.completions.create(**kw, n=3, seed=11, stream=True))
    texts = ["".join(c.choices[0].delta.content or "" for c in stream if c.choices and c.choices[0].index == i)
             for i in range(3)]
    assert texts == alone and len(set(alone)) == 3


# ---- defaults, names, fields ----------------------------------------------------------------------
def test_max_tokens_left_out_runs_to_the_end_of_the_context(hermes):
    out = _client(hermes).completions.create(model="tiny", prompt="The quick brown fox",
                                             extra_body={"ignore_eos": True})
    assert out.choices[0].finish_reason == "length"
    assert out.usage.prompt_tokens + out.usage.completion_tokens == 1024


def test_the_models_sampling_defaults_apply_to_fields_left_out(hermes):
    props = httpx.get(hermes.url + "/props").json()
    assert props["sampling_defaults"] == GENERATION
    client = _client(hermes)
    kw = dict(model="tiny", prompt="defaults", max_tokens=12, extra_body={"ignore_eos": True})
    greedy = client.completions.create(**kw, temperature=0).choices[0].text
    assert [client.completions.create(**kw).choices[0].text for _ in range(2)] == [greedy, greedy]
    loose = {client.completions.create(**(kw | {"extra_body": {"top_k": 0, "ignore_eos": True}}),
                                       temperature=1.0, seed=s).choices[0].text for s in range(4)}
    assert len(loose) > 1


def test_served_model_names_are_the_only_names_and_patterns_match_more(hermes):
    models = httpx.get(hermes.url + "/v1/models").json()["data"]
    assert [m["id"] for m in models] == ["tiny", "tiny-alias"]          # a pattern is never listed
    assert _client(hermes).completions.create(model="tiny-alias", prompt="x", max_tokens=1).choices
    # what Claude Code sends unless told otherwise, through the pattern claude-*
    reply = _client(hermes).chat.completions.create(model="claude-sonnet-4-5", messages=ASK, max_tokens=1)
    assert reply.model == "claude-sonnet-4-5" and reply.choices
    for name in ("tiny-hermes", "gpt-4o", "Claude-sonnet"):            # patterns match case and all
        r = httpx.post(hermes.url + "/v1/completions", json={"model": name, "prompt": "x"})
        assert r.status_code == 404 and "'tiny' or 'tiny-alias' or 'claude-*'" in r.json()["error"]["message"]


BAD = [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}]},
     "tools.0.function.parameters", "objekt"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", "'nope'"),
    ({"tool_choice": "required"}, "tool_choice", "no tools"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}},
     "response_format.json_schema.schema", "json schema"),
    ({"guided_regex": "(ab"}, "guided_regex", "unclosed group"),
    ({"response_format": {"type": "json_object"}, "guided_choice": ["a"]}, "guided_choice", "one output"),
    ({"logit_bias": {"999999": 5}}, "logit_bias", "999999"),
    ({"logit_bias": {"x": 5}}, "logit_bias", "token ids"),
    ({"n": 0}, "n", "greater than or equal to 1"),
    ({"functions": [{"name": "f"}]}, "functions", "send `tools`"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages.0.content.0.type", "image_url"),
    ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs", "tools"),
]


@pytest.mark.parametrize("extra,param,words", BAD, ids=[b[1] for b in BAD])
def test_bad_agent_input_is_a_400_naming_the_param(hermes, extra, param, words):
    assert_refused(hermes, "/v1/chat/completions", {"model": "tiny", "messages": ASK, "max_tokens": 2} | extra,
                   param, words)


def test_unknown_fields_are_ignored_and_logged_once(hermes):
    for _ in range(2):
        r = httpx.post(hermes.url + "/v1/chat/completions",
                       json={"messages": ASK, "max_tokens": 1, "frobnicate_level": 3})
        assert r.status_code == 200
    assert hermes.output().count("'frobnicate_level'") == 1


# ---- reasoning (a template that opens <think>) and the XML call format -----------------------------
def _think_end(server) -> dict:
    """A bias that makes the random model close its reasoning after a few tokens."""
    from pathlib import Path
    model = Path(server.proc.args[server.proc.args.index("--model") + 1])
    return {str(tag_id(model, "</think>")): 4}


def test_reasoning_is_split_from_the_answer(thinking):
    client = _client(thinking)
    kw = dict(model="tiny-xml", messages=ASK, temperature=1.0, max_tokens=300, logit_bias=_think_end(thinking),
              response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER}})
    thought = []
    for seed in range(3):
        message = client.chat.completions.create(**kw, seed=seed).choices[0].message
        jsonschema.validate(json.loads(message.content), WEATHER)
        thought.append(message.reasoning_content)
        chunks = list(client.chat.completions.create(**kw, seed=seed, stream=True))
        _no_raw_tags(chunks)
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == (message.reasoning_content or "")
        assert "".join(d.content or "" for d in deltas) == message.content
    assert any(thought)
    off = client.chat.completions.create(**kw, seed=0, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert off.choices[0].message.reasoning_content is None
    jsonschema.validate(json.loads(off.choices[0].message.content), WEATHER)


def test_auto_mode_holds_the_calls_after_the_reasoning_too(thinking):
    """With the prompt's <think> open and tool_choice auto, the reasoning stays free and each call the
    model opens after it is held to a well-formed call (a random model writes anything after the tag)."""
    from pathlib import Path
    model = Path(thinking.proc.args[thinking.proc.args.index("--model") + 1])
    client = _client(thinking)
    kw = dict(model="tiny-xml", messages=ASK, tools=TOOLS, temperature=1.0, max_tokens=300,
              stop=["</tool_call>"], logit_bias=_think_end(thinking) | {str(tag_id(model, "<tool_call>")): 3})
    reasoned_calls = 0
    for seed in range(6):
        message = client.chat.completions.create(**kw, seed=seed).choices[0].message
        for name, arguments in _calls(message):
            jsonschema.validate(arguments, SCHEMAS[name])
            reasoned_calls += bool(message.reasoning_content)
    assert reasoned_calls


def test_xml_tool_calls_with_and_without_reasoning(thinking):
    client = _client(thinking)
    kw = dict(model="tiny-xml", messages=ASK, tools=TOOLS, tool_choice="required", temperature=0,
              max_tokens=300, parallel_tool_calls=False)
    quick = client.chat.completions.create(**kw, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    calls = _calls(quick.choices[0].message)
    assert quick.choices[0].finish_reason == "tool_calls" and len(calls) == 1
    jsonschema.validate(calls[0][1], SCHEMAS[calls[0][0]])
    final, chunks = _stream(client, **kw, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert _calls(final.choices[0].message) == calls
    _no_raw_tags(chunks)
    reasoned = []
    for seed in range(3):       # the call comes after the reasoning, and is enforced there too
        out = client.chat.completions.create(**(kw | {"temperature": 1.0}), seed=seed,
                                             logit_bias=_think_end(thinking))
        (name, arguments), = _calls(out.choices[0].message)
        assert out.choices[0].finish_reason == "tool_calls"
        jsonschema.validate(arguments, SCHEMAS[name])
        reasoned.append(out.choices[0].message.reasoning_content)
    assert any(reasoned)
