"""The console's HTTP client against a fake server (httpx.MockTransport) speaking the server's
contract, the ReplyBuffer's batching and cancel, key remapping validation, session files."""
from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from console.client import ConsoleClientError, HttpClient, ReplyBuffer, ReplyDelta
from console.keys import BINDING_IDS, keymap
from console.sessions import ReplyStats, Session, SessionStore, Turn
from engine.config import ConfigError


def sse(*chunks) -> bytes:
    return b"".join(f"data: {c if isinstance(c, str) else json.dumps(c)}\n\n".encode() for c in chunks)


def chunk(rid: str, text: str | None = None, finish: str | None = None) -> dict:
    delta = {"content": text} if text is not None else {}
    return {"id": rid, "object": "chat.completion.chunk", "choices": [
        {"index": 0, "delta": delta, "finish_reason": finish}]}


class FakeServer:
    """Records requests; answers the routes the console uses."""

    def __init__(self, key: str = "sekrit", **props):
        self.key, self.seen, self.health_calls, self.props = key, [], 0, props

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.seen.append((request.method, request.url.path, request.content))
        if request.headers.get("authorization") != f"Bearer {self.key}":
            return httpx.Response(401, json={"error": {"message": "invalid API key"}})
        route = (request.method, request.url.path)
        if route == ("GET", "/health"):
            self.health_calls += 1
            if self.health_calls == 1:
                return httpx.Response(503, json={"status": "loading", "error": None})
            return httpx.Response(200, json={"status": "ok"})
        if route == ("GET", "/props"):
            return httpx.Response(200, json={"model": "tiny-qwen", "max_model_len": 512,
                                             "kv_pool_tokens": 65664, "kv_pool_bytes": 3 * 2**30 // 2,
                                             "kv_cache_dtype": "bfloat16"} | self.props)
        if route == ("POST", "/v1/chat/completions"):
            usage = {"id": "req-7", "choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 2,
                                                             "prompt_tokens_details": {"cached_tokens": 4}}}
            return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=sse(
                chunk("req-7", ""), chunk("req-7", "Hel"), chunk("req-7", "lo"),
                chunk("req-7", finish="length"), usage, "[DONE]"))
        if route == ("GET", "/v1/requests"):
            return httpx.Response(200, json={"object": "list", "data": [
                {"id": "req-7", "client": "curl", "state": "decode", "prompt_tokens": 5,
                 "generated_tokens": 2, "blocks": 1, "slot": None, "tokens_per_s": 4.5, "age_s": 0.3}],
                "stats": {"running": 1, "waiting": 0, "paused": 0, "blocks_used": 1, "blocks_total": 32,
                          "slots_used": 0, "slots_total": 0, "prompt_tokens_per_s": 0.0,
                          "generation_tokens_per_s": 4.5, "ttft_p50_s": 0.1, "itl_p50_s": 0.02,
                          "itl_p99_s": 0.05, "preemptions_total": 0}})
        if request.method == "DELETE" and request.url.path.startswith("/v1/requests/"):
            return httpx.Response(200, json={"id": request.url.path.rsplit("/", 1)[1], "cancelled": True})
        return httpx.Response(404, json={"error": {"message": "no route"}})


def http_client(server: FakeServer, key: str = "sekrit") -> HttpClient:
    return HttpClient("http://127.0.0.1:8000/", key, transport=httpx.MockTransport(server))


def test_the_description_names_the_rotary_scaling_that_stretches_the_context():
    server = FakeServer(max_model_len=131072, rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                            "original_max_position_embeddings": 32768})
    assert http_client(server).connect(progress=lambda d, t: None).startswith(
        "tiny-qwen · http://127.0.0.1:8000 · 131,072-token context (yarn x4) · 65,664 K/V tokens")


def test_http_client_streams_a_reply_with_the_engine_id_and_usage():
    server = FakeServer()
    client = http_client(server)
    assert (client.connect(progress=lambda d, t: None)
            == "tiny-qwen · http://127.0.0.1:8000 · 512-token context · 65,664 K/V tokens (1.5 GiB, bfloat16)")
    reply = client.stream([{"role": "user", "content": "hi"}], temperature=0.0, max_tokens=2, client="s1")
    deltas = list(reply)
    assert "".join(d.text for d in deltas) == "Hello" and reply.id == "req-7"
    assert deltas[-1] == ReplyDelta(finish_reason="length", prompt_tokens=5, completion_tokens=2, cached_tokens=4)
    assert server.health_calls == 2                      # it waited for the server's model to load
    body = json.loads(server.seen[-1][2])
    assert "model" not in body                           # the server's own model
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert (body["messages"], body["max_tokens"], body["temperature"], body["user"]) == (
        [{"role": "user", "content": "hi"}], 2, 0.0, "s1")


def test_http_client_reads_the_request_table_and_cancels_by_id():
    server = FakeServer()
    client = http_client(server)
    snap = client.snapshot()
    assert (snap.running, snap.blocks_total, snap.itl_p99_s) == (1, 32, 0.05)
    (row,) = snap.requests
    assert (row.id, row.client, row.state, row.generated_tokens, row.tokens_per_s) == ("req-7", "curl", "decode", 2, 4.5)
    client.cancel("req-7")
    assert server.seen[-1][:2] == ("DELETE", "/v1/requests/req-7")


def test_http_client_cancel_mid_stream_deletes_the_request_and_ends_cancelled():
    server = FakeServer()
    client = http_client(server)
    reply = client.stream([{"role": "user", "content": "hi"}], temperature=1.0, max_tokens=9, client="s1")
    stream = iter(reply)
    first = next(stream)
    assert first.text == "" or first.text == "Hel"
    reply.cancel()
    rest = list(stream)
    assert rest[-1].finish_reason == "cancelled"
    assert ("DELETE", "/v1/requests/req-7") in [s[:2] for s in server.seen]


def test_http_client_errors_name_the_fix():
    with pytest.raises(ConsoleClientError, match="--api-key"):
        http_client(FakeServer(), key="wrong").connect(progress=lambda d, t: None)

    def down(request):
        raise httpx.ConnectError("connection refused")
    client = HttpClient("http://127.0.0.1:9", transport=httpx.MockTransport(down))
    with pytest.raises(ConsoleClientError, match="pagedserve serve"):
        client.connect(progress=lambda d, t: None)
    (delta,) = list(client.stream([], temperature=1.0, max_tokens=1, client=""))
    assert delta.finish_reason == "error" and "connection refused" in delta.error
    (delta,) = list(http_client(FakeServer(), key="wrong").stream([], temperature=1.0, max_tokens=1, client=""))
    assert delta.error == "HTTP 401: invalid API key"


class HeldStream:
    def __init__(self):
        self.id, self.cancelled, self.go = "r", threading.Event(), threading.Event()

    def __iter__(self):
        for i in range(3):
            yield ReplyDelta(f"t{i}", completion_tokens=i + 1)
        self.go.wait(5)
        yield ReplyDelta(finish_reason="cancelled" if self.cancelled.is_set() else "stop", completion_tokens=3)

    def cancel(self):
        self.cancelled.set()
        self.go.set()


def test_reply_buffer_batches_text_and_applies_an_early_cancel():
    ticks = iter(range(100))
    stream = HeldStream()
    opened = threading.Event()

    def open_stream():
        opened.wait(5)
        return stream
    buffer = ReplyBuffer(open_stream, clock=lambda: float(next(ticks)))
    buffer.start()
    buffer.cancel()                      # before the stream exists: applied once it does
    opened.set()
    text, final = "", None
    while final is None:
        part, final = buffer.take()
        text += part
        time.sleep(0.001)
    assert text == "t0t1t2" and final.finish_reason == "cancelled"
    # clock: start 0, tokens at 1, 2, 3 -> ttft 1 s, 2 more tokens over 2 s
    assert buffer.rates() == (1.0, 1.0)


def test_reply_buffer_turns_a_failing_stream_into_an_error_reply():
    def broken():
        raise ValueError("prompt is 9,000 tokens; max_model_len is 512")
    buffer = ReplyBuffer(broken)
    buffer.start()
    while (final := buffer.take()[1]) is None:
        time.sleep(0.001)
    assert final.finish_reason == "error" and "max_model_len is 512" in final.error


def test_keymap_checks_binding_ids_with_did_you_mean():
    assert keymap({"quit": "ctrl+x", "monitor": "f9, ctrl+m"}) == {"quit": "ctrl+x", "monitor": "f9,ctrl+m"}
    with pytest.raises(ConfigError, match="console.keys.qiut: unknown binding id; did you mean 'quit'"):
        keymap({"qiut": "ctrl+x"})
    with pytest.raises(ConfigError, match="console.keys.stop"):
        keymap({"stop": " "})
    assert {"new_session", "close_session", "next_session", "previous_session", "send", "stop",
            "regenerate", "monitor", "quit", "cancel_request"} <= set(BINDING_IDS)


def test_sessions_round_trip_through_json_and_export_to_markdown(tmp_path):
    store = SessionStore(tmp_path)
    session = Session("abc", "Code / review", "Be terse.", 0.2, 64, [
        Turn("user", "hi"), Turn("assistant", "```py\nx = 1\n```", ReplyStats(4, 12.5, 0.25, "stop"))])
    store.save(session)
    store.save(Session("def", "Other"))
    (tmp_path / "sessions" / "broken.json").write_text("{not json")
    loaded = {s.id: s for s in store.load_all()}
    assert loaded["abc"] == session and loaded["def"].turns == []
    assert len(store.errors) == 1 and "broken.json" in store.errors[0]
    path = store.export_markdown(session)
    assert path.name == "Code-review.md"
    assert path.read_text() == (
        "# Code / review\n\n*System:* Be terse.\n\n## You\n\nhi\n\n## Assistant\n\n```py\nx = 1\n```\n\n"
        "*4 tokens · 12.5 tok/s · first token 250 ms · stop*\n")
    assert ReplyStats(4, 12.5, 0.25, "stop", 1536).line() == (
        "4 tokens · 12.5 tok/s · first token 250 ms · 1,536 prompt tokens cached · stop")
    store.delete("abc")
    assert [s.id for s in store.load_all()] == ["def"]
