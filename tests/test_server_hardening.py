"""What a hostile or careless client found, each fixed: lone surrogates, the operator's request table,
an operator's cancel, degenerate sampling values, a long tokenization on the event loop, logprobs
offsets and bytes, slow request headers, and /health while draining. A real `pagedserve serve` on a
tiny model."""
from __future__ import annotations

import json
import signal
import socket
import threading
import time

import httpx
import pytest

from server_process import ServerProcess
from test_server import TINY
from test_server_load import _raw_stream

KEY, ADMIN = "sk-user", "sk-operator"
USER, OPERATOR = {"Authorization": f"Bearer {KEY}"}, {"Authorization": f"Bearer {ADMIN}"}


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    with ServerProcess(tiny_checkpoint("qwen3", **TINY), "--api-key", KEY, "--admin-key", ADMIN,
                       "--max-body-bytes", "8000000", "--header-timeout-s", "0.5",
                       max_model_len=1024, kv_pool_tokens=16384) as srv:
        yield srv


def _post(server, path: str, body: dict | bytes, headers=USER) -> httpx.Response:
    if isinstance(body, bytes):
        return httpx.post(server.url + path, content=body, timeout=60,
                          headers=headers | {"content-type": "application/json"})
    return httpx.post(server.url + path, json=body, headers=headers, timeout=60)


LONE = [
    ("/tokenize", rb'{"prompt": "a\ud800b"}'),
    ("/v1/completions", rb'{"prompt": "a\udc00b", "max_tokens": 2}'),
    ("/v1/chat/completions", rb'{"messages": [{"role": "user", "content": "hi \ud800"}], "max_tokens": 2}'),
    ("/v1/completions", rb'{"prompt": "hi", "max_tokens": 2, "user": "\ud800"}'),
    ("/v1/messages", rb'{"max_tokens": 2, "messages": [{"role": "user", "content": "\ud800x"}]}'),
]


@pytest.mark.parametrize("path,body", LONE, ids=[f"{p}-{i}" for i, (p, _) in enumerate(LONE)])
def test_a_lone_surrogate_is_a_400_on_every_route(server, path, body):
    r = _post(server, path, body)
    assert r.status_code == 400, r.text
    assert "lone UTF-16 surrogate" in r.text
    table = httpx.get(server.url + "/v1/requests", headers=OPERATOR)
    assert table.status_code == 200                     # nothing it left behind breaks the table


def test_a_surrogate_pair_and_an_escaped_backslash_are_fine(server):
    ok = _post(server, "/tokenize", rb'{"prompt": "\ud83d\ude00 and \\ud800"}')
    assert ok.status_code == 200 and ok.json()["count"] > 0


def test_the_request_table_is_the_operators(server):
    assert httpx.get(server.url + "/v1/requests", headers=USER).status_code == 403
    denied = httpx.delete(server.url + "/v1/requests/cmpl-x", headers=USER)
    assert denied.status_code == 403 and denied.json()["error"]["code"] == "admin_only"
    assert httpx.get(server.url + "/v1/requests", headers=OPERATOR).status_code == 200
    assert httpx.delete(server.url + "/v1/requests/cmpl-x", headers=OPERATOR).status_code == 404
    assert _post(server, "/v1/completions", {"prompt": "x", "max_tokens": 1}, OPERATOR).status_code == 200


def test_without_an_admin_key_the_table_answers_loopback_only():
    from types import SimpleNamespace

    from server.admin_routes import require_operator
    from server.errors import APIError

    def caller(ip: str):
        host = SimpleNamespace(server_cfg=SimpleNamespace(admin_key=""))
        return SimpleNamespace(app=SimpleNamespace(state=SimpleNamespace(host=host)),
                               client=SimpleNamespace(host=ip), scope={"headers": []})
    require_operator(caller("127.0.0.1"))
    require_operator(caller("::1"))
    with pytest.raises(APIError) as refused:
        require_operator(caller("10.1.2.3"))
    assert refused.value.status == 403 and "loopback" in refused.value.message


def test_an_operators_cancel_reaches_the_client_as_an_error(server):
    answer: dict = {}

    def ask() -> None:
        answer["r"] = _post(server, "/v1/completions", {"prompt": "long", "max_tokens": 900, "ignore_eos": True})
    thread = threading.Thread(target=ask)
    thread.start()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        rows = httpx.get(server.url + "/v1/requests", headers=OPERATOR).json()["data"]
        if rows:
            break
        time.sleep(0.01)
    assert httpx.delete(server.url + f"/v1/requests/{rows[0]['id']}", headers=OPERATOR).status_code == 200
    thread.join(60)
    r = answer["r"]
    assert r.status_code == 503 and r.json()["error"]["code"] == "cancelled"   # never a 200 "cancelled"


def test_degenerate_sampling_values(server):
    body = {"prompt": "The quick", "max_tokens": 8, "ignore_eos": True}
    greedy = _post(server, "/v1/completions", body | {"temperature": 0}).json()["choices"][0]["text"]
    tiny = _post(server, "/v1/completions", body | {"temperature": 1e-45}).json()["choices"][0]["text"]
    assert tiny == greedy and greedy
    r = _post(server, "/v1/completions", body | {"repetition_penalty": 1e-300})
    assert r.status_code == 400 and r.json()["error"]["param"] == "repetition_penalty"
    r = _post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True,
                                               "top_logprobs": 21})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs"


def test_a_long_tokenization_does_not_hold_up_the_server(server):
    """A 4 MB prompt takes seconds to tokenize; done on the event loop, a /health sent meanwhile
    waited for it. The order of the answers shows where it ran (the sleep only sequences the
    requests, nothing is timed)."""
    done: list[str] = []

    def tokenize() -> None:
        _post(server, "/tokenize", {"prompt": "def f(x):\n    return x * 2  # a comment\n" * 100_000})
        done.append("tokenize")
    thread = threading.Thread(target=tokenize)
    thread.start()
    time.sleep(0.3)
    assert httpx.get(server.url + "/health", timeout=60).status_code == 200
    done.append("health")
    thread.join(60)
    assert done == ["health", "tokenize"]


def test_streamed_logprobs_offsets_go_on_and_bytes_are_the_tokens_own(server):
    body = {"prompt": "Schöne Grüße", "max_tokens": 12, "temperature": 0, "ignore_eos": True, "logprobs": 1}
    whole = _post(server, "/v1/completions", body).json()["choices"][0]["logprobs"]
    with httpx.stream("POST", server.url + "/v1/completions", json=body | {"stream": True}, headers=USER) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    offsets = [o for c in chunks if c["choices"] and c["choices"][0]["logprobs"]
               for o in c["choices"][0]["logprobs"]["text_offset"]]
    assert offsets == whole["text_offset"] and len(set(offsets)) == len(offsets)
    chat = _post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "敏捷的狐狸"}],
                                                  "max_tokens": 16, "temperature": 0, "logprobs": True}).json()
    # each token's bytes, joined, are the reply's bytes (a token alone may be part of a character)
    joined = b"".join(bytes(t["bytes"]) for t in chat["choices"][0]["logprobs"]["content"])
    assert joined.decode("utf-8", errors="replace") == chat["choices"][0]["message"]["content"]


def test_a_client_that_trickles_its_headers_is_cut_off(server):
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.settimeout(30)                 # a bound on the wait, not a measured speed
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
    for _ in range(600):                # a header line every 50 ms, for at most half a minute
        try:
            sock.sendall(b"X-Slow: 1\r\n")
        except (BrokenPipeError, ConnectionResetError):
            break
        time.sleep(0.05)
    else:
        pytest.fail("the server kept a connection open whose headers never end")
    try:
        assert sock.recv(100) == b""
    except ConnectionResetError:
        pass                            # closed with a reset: closed all the same
    sock.close()
    assert httpx.get(server.url + "/health").status_code == 200


def test_health_says_draining_while_requests_finish(server):
    """Runs last: it ends the module's server. A reader that reads nothing keeps its request live,
    so the drain is still going when /health is asked."""
    slow = _raw_stream(server.port, {"prompt": "slow", "max_tokens": 900, "ignore_eos": True, "logprobs": 20,
                                     "temperature": 0}, headers=f"Authorization: Bearer {KEY}\r\n")
    deadline = time.monotonic() + 30
    while not httpx.get(server.url + "/v1/requests", headers=OPERATOR).json()["data"]:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    server.proc.send_signal(signal.SIGTERM)
    health = None
    while time.monotonic() < deadline:
        health = httpx.get(server.url + "/health")
        if health.status_code == 503:
            break
        time.sleep(0.02)
    assert health.status_code == 503 and health.json()["status"] == "draining"
    refused = _post(server, "/v1/completions", {"prompt": "x", "max_tokens": 1})
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"
    slow.close()                                        # its request is cancelled: the drain ends
    assert server.proc.wait(60) == 0
