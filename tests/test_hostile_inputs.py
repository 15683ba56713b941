"""Hostile HTTP input beyond schemathesis' generated cases, against one real `pagedserve serve` on a
tiny model: bodies over the size limit, 100k-message chats, deeply nested JSON, invalid UTF-8, NUL
bytes, lone surrogates, and limits at and past their bounds. Each gets a 4xx whose message names the
problem, or a 200 where the input is legal; never a 5xx, never a hang (every wait has a timeout).
After every test the server still answers a normal request and its RSS has grown by less than a bound.
"""
from __future__ import annotations

import json

import httpx
import psutil
import pytest
from tokenizers import Tokenizer

from server_process import ServerProcess

MAX_MODEL_LEN = 256
MAX_BODY_BYTES = 8 * 2**20       # over the 100k-message chat (3.4 MB), under the 10 MB bodies
RSS_GROWTH_BOUND = 512 * 2**20   # seen: ~190 MiB, nearly all from parsing the 100k-message chat; a leak is more
TIMEOUT_S = 60
TINY = dict(tied=False, heads=8, kv_heads=2, head_dim=32, max_pos=2048)
HELLO = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def model_dir(tiny_checkpoint):
    return tiny_checkpoint("qwen3", **TINY)


@pytest.fixture(scope="module")
def server(model_dir):
    with ServerProcess(model_dir, "--max-concurrency", "4", max_model_len=MAX_MODEL_LEN,
                       env={"PAGEDSERVE_MAX_BODY_BYTES": str(MAX_BODY_BYTES)}) as srv:
        srv.rss_at_start = psutil.Process(srv.proc.pid).memory_info().rss
        yield srv


@pytest.fixture(autouse=True)
def still_serving(server):
    """After each case: a normal request answers and memory stayed bounded."""
    yield
    assert normal_completion(server)["choices"][0]["finish_reason"] == "length"
    growth = psutil.Process(server.proc.pid).memory_info().rss - server.rss_at_start
    assert growth < RSS_GROWTH_BOUND, f"server RSS grew by {growth / 2**20:.0f} MiB"


def normal_completion(server) -> dict:
    r = post(server, "/v1/completions", {"prompt": "The quick", "max_tokens": 4, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()


def post(server, path: str, body: dict | str | bytes) -> httpx.Response:
    """dict: sent as JSON; str: JSON text sent as written (for escapes json.dumps would not write);
    bytes: sent raw. A new connection each time: the server closes one after a 500."""
    if isinstance(body, dict):
        return httpx.post(server.url + path, json=body, timeout=TIMEOUT_S)
    content = body.encode() if isinstance(body, str) else body
    return httpx.post(server.url + path, content=content, headers={"content-type": "application/json"},
                      timeout=TIMEOUT_S)


def assert_refused(r: httpx.Response, status: int, words: str, param: str | None = None) -> None:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert words in error["message"], error
    if param is not None:
        assert error["param"] == param, error


def sse_events(body: bytes) -> list[str]:
    """The data of each event, split at LF only, as SSE ends lines: str.splitlines (and httpx's
    iter_lines) also split at U+0085 and U+2028, which a random model's JSON text holds now and then."""
    return [line[6:].decode() for line in body.split(b"\n") if line.startswith(b"data: ")]


def nested(depth: int, opener: str = "[", closer: str = "]") -> str:
    return opener * depth + closer * depth


# ---- size ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("chunked", [False, True], ids=["declared", "chunked"])
def test_a_10_mb_body_is_413(server, chunked):
    body = b'{"prompt": "' + b"x" * (10 * 2**20) + b'"}'
    content = iter([body[i:i + 2**20] for i in range(0, len(body), 2**20)]) if chunked else body
    r = httpx.post(server.url + "/v1/completions", content=content, timeout=TIMEOUT_S,
                   headers={"content-type": "application/json"})
    assert_refused(r, 413, f"server.max_body_bytes = {MAX_BODY_BYTES:,} bytes")


def test_a_100k_message_chat_is_400_and_a_running_stream_finishes(server):
    body = {"prompt": "The quick", "max_tokens": 40, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=TIMEOUT_S) as stream:
        chunks = stream.iter_bytes()
        received = next(chunks)                 # the stream has begun
        r = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}] * 100_000,
                                                  "max_tokens": 2})
        events = sse_events(received + b"".join(chunks))
    assert_refused(r, 400, f"max_model_len is {MAX_MODEL_LEN}", "messages")
    assert events[-1] == "[DONE]" and '"finish_reason":"length"' in events[-2]


# ---- structure and encoding ----------------------------------------------------------------------

DEEP = 100_000
DEEP_BODIES = {
    "unknown field": '{"prompt": "hi", "max_tokens": 2, "x": %s}' % nested(DEEP),
    "prompt": '{"prompt": %s, "max_tokens": 2}' % nested(DEEP),
    "chat_template_kwargs": '{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, '
                            '"chat_template_kwargs": {"a": %s}}' % nested(DEEP),
    "schema objects": '{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "response_format": '
                      '{"type": "json_schema", "json_schema": {"name": "a", "schema": %s}}}'
                      % ('{"a": ' * DEEP + "{}" + "}" * DEEP),
}


@pytest.mark.parametrize("where", DEEP_BODIES)
def test_100k_deep_json_is_400(server, where):
    path = "/v1/completions" if where in ("unknown field", "prompt") else "/v1/chat/completions"
    assert_refused(post(server, path, DEEP_BODIES[where]), 400, "could not be parsed as JSON")


def test_json_just_under_the_parser_depth_is_ignored_or_refused_by_the_schema_compiler(server):
    extra = '{"prompt": "hi", "max_tokens": 2, "x": %s}' % nested(900)
    assert post(server, "/v1/completions", extra).status_code == 200           # an unknown field: ignored
    schema = {"type": "json_schema", "json_schema": {"name": "a", "schema": {"a": json.loads(nested(900))}}}
    r = post(server, "/v1/chat/completions", {"messages": HELLO, "max_tokens": 2, "response_format": schema})
    assert_refused(r, 400, "json schema is not valid", "response_format.json_schema.schema")


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", b'{"prompt": "\xff\xfe hi", "max_tokens": 2}'),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\xc3\x28"}], "max_tokens": 2}'),
], ids=["prompt", "messages"])
def test_invalid_utf8_bytes_are_400(server, path, body):
    assert_refused(post(server, path, body), 400, "not valid UTF-8")


@pytest.mark.parametrize("path,body", [
    ("/tokenize", b'{"prompt": "\xed\xa0\x80"}'),
    ("/v1/completions", b'{"prompt": "\xed\xa0\x80", "max_tokens": 2}'),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\xed\xa0\x80"}], "max_tokens": 2}'),
], ids=["tokenize", "completions", "chat"])
def test_surrogate_bytes_are_400(server, path, body):
    """ED A0 80 is U+D800 written as UTF-8 would if it allowed surrogates (CESU-8): invalid UTF-8."""
    assert_refused(post(server, path, body), 400, "not valid UTF-8 (byte")


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "a\x00b", "max_tokens": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a\x00b"}], "max_tokens": 2}),
    ("/v1/completions", {"prompt": "ab", "max_tokens": 2, "user": "a\x00b"}),
    ("/v1/completions", {"prompt": "ab", "max_tokens": 2, "stop": ["\x00"]}),
], ids=["prompt", "messages", "user", "stop"])
def test_nul_bytes_in_strings_are_legal(server, path, body):
    r = post(server, path, body)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] in ("length", "stop")


def test_nul_bytes_tokenize(server):
    r = post(server, "/tokenize", {"prompt": "a\x00b"})
    assert r.status_code == 200 and r.json()["count"] == len(r.json()["tokens"]) >= 3


# ---- lone surrogates ------------------------------------------------------------------------------

SURROGATE_REFUSED = [
    ("/v1/completions", '{"prompt": "a\\ud800b", "max_tokens": 2}'),
    ("/v1/completions", '{"prompt": "\\udfff", "max_tokens": 2, "stream": true}'),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\ud800"}], "max_tokens": 2}'),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud800"}]}], '
                             '"max_tokens": 2}'),
    ("/tokenize", '{"prompt": "\\ud800"}'),
    ("/tokenize", '{"messages": [{"role": "user", "content": "\\ud800"}]}'),
    ("/v1/messages", '{"model": "x", "max_tokens": 2, "messages": [{"role": "user", "content": "\\ud800"}]}'),
    ("/v1/responses", '{"input": "\\ud800", "max_output_tokens": 2}'),
]


@pytest.mark.parametrize("path,body", SURROGATE_REFUSED,
                         ids=["prompt", "prompt-stream", "messages", "content-part", "tokenize", "tokenize-messages",
                              "anthropic", "responses"])
def test_a_lone_surrogate_in_text_is_400(server, path, body):
    r = post(server, path, body)
    assert r.status_code == 400, r.text
    assert "surrogate" in r.text or "Unicode" in r.text, r.text


@pytest.mark.parametrize("body", [
    '{"prompt": "ab", "max_tokens": 2, "stop": ["\\ud800"]}',           # a stop that can never match
    '{"prompt": "ab", "max_tokens": 2, "user": "\\ud800"}',             # only a label
], ids=["stop", "user"])
def test_a_lone_surrogate_where_it_is_only_a_label_is_200_or_400(server, body):
    r = post(server, "/v1/completions", body)
    assert r.status_code == 200 or (r.status_code == 400 and "surrogate" in r.text), r.text


def test_an_escaped_surrogate_pair_is_one_character(server):
    r = post(server, "/tokenize", '{"prompt": "\\ud83d\\ude42"}')
    assert r.status_code == 200 and r.json()["tokens"] == post(server, "/tokenize", {"prompt": "🙂"}).json()["tokens"]


def test_a_lone_surrogate_in_user_leaves_the_request_table_readable(server):
    body = '{"prompt": "ab", "max_tokens": 200, "ignore_eos": true, "stream": true, "user": "\\ud800x"}'
    with httpx.stream("POST", server.url + "/v1/completions", content=body.encode(), timeout=TIMEOUT_S,
                      headers={"content-type": "application/json"}) as stream:
        if stream.status_code == 400:
            return                              # refused at the door: nothing to list
        assert next(line for line in stream.iter_lines() if line.startswith("data: "))
        table = httpx.get(server.url + "/v1/requests", timeout=TIMEOUT_S)
    assert table.status_code == 200, table.text


@pytest.mark.parametrize("separator", ["\x85", "\u2028"], ids=["U+0085", "U+2028"])
def test_a_reply_holding_unicode_line_separators_streams_line_by_line(server, model_dir, separator):
    ids = Tokenizer.from_file(str(model_dir / "tokenizer.json")).encode(separator).ids
    # a random model writes these bytes now and then; biased to them, it writes little else (seeded)
    body = {"prompt": "hi", "max_tokens": 60, "temperature": 1.0, "seed": 0, "ignore_eos": True, "stream": True,
            "logit_bias": {str(i): 100 for i in ids}}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=TIMEOUT_S) as r:
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith(("data: ", ":")) for line in lines), [line[:60] for line in lines][:5]


# ---- limits -------------------------------------------------------------------------------------

@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "ab", "max_tokens": 10**9}),
    ("/v1/completions", {"prompt": "ab", "max_tokens": 2**63}),
    ("/v1/completions", {"prompt": "ab", "max_tokens": 10**30}),
    ("/v1/chat/completions", {"messages": HELLO, "max_completion_tokens": 10**9}),
], ids=["1e9", "2^63", "1e30", "chat-1e9"])
def test_huge_max_tokens_is_clamped_to_the_context(server, path, body):
    r = post(server, path, body | {"ignore_eos": True})
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] == MAX_MODEL_LEN
    assert r.json()["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_10k_stop_strings_all_apply(server, stream):
    body = {"prompt": [17, 250, 3, 99], "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    text = post(server, "/v1/completions", body).json()["choices"][0]["text"]
    start = next(i for i in range(1, len(text) - 1) if "\ufffd" not in text[i:i + 2])
    stop = text[start:start + 2]                   # one real stop, hidden among 9,999 that never match
    stops = [f"never-{i}" for i in range(9_999)] + [stop]
    r = post(server, "/v1/completions", body | {"stop": stops, "stream": stream})
    assert r.status_code == 200, r.text
    if stream:
        chunks = [json.loads(event) for event in sse_events(r.content) if event.startswith("{")]
        got, reason = "".join(c["choices"][0]["text"] for c in chunks), chunks[-1]["choices"][0]["finish_reason"]
    else:
        got, reason = r.json()["choices"][0]["text"], r.json()["choices"][0]["finish_reason"]
    assert (got, reason) == (text[:text.index(stop)], "stop")


def test_logprobs_at_their_limit(server):
    r = post(server, "/v1/completions", {"prompt": "ab", "max_tokens": 2, "logprobs": 20})
    assert r.status_code == 200 and len(r.json()["choices"][0]["logprobs"]["token_logprobs"]) == 2
    r = post(server, "/v1/chat/completions", {"messages": HELLO, "max_tokens": 2, "logprobs": True,
                                              "top_logprobs": 20})
    assert r.status_code == 200, r.text
    assert [len(t["top_logprobs"]) for t in r.json()["choices"][0]["logprobs"]["content"]] == [20, 20]


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "ab", "max_tokens": 2, "logprobs": 21}),
    ("/v1/completions", {"prompt": "ab", "max_tokens": 2, "logprobs": -1}),
    ("/v1/chat/completions", {"messages": HELLO, "max_tokens": 2, "logprobs": True, "top_logprobs": 21}),
    ("/v1/chat/completions", {"messages": HELLO, "max_tokens": 2, "logprobs": True, "top_logprobs": 10**30}),
], ids=["completions-21", "completions--1", "chat-21", "chat-1e30"])
def test_logprobs_past_their_limit_are_400(server, path, body):
    assert_refused(post(server, path, body), 400, "must be in [0, 20]")


def test_top_logprobs_without_logprobs_is_400(server):
    r = post(server, "/v1/chat/completions", {"messages": HELLO, "max_tokens": 2, "top_logprobs": 3})
    assert_refused(r, 400, "top_logprobs needs logprobs=true", "top_logprobs")
