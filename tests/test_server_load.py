"""The server under load, as clients see it: disconnects and stalls free everything, a slow reader
slows nobody else, concurrency never changes a greedy answer, SIGTERM drains and exits 0.
One `pagedserve serve` process for the module; the shutdown test runs last and ends it."""
from __future__ import annotations

import asyncio
import json
import random
import signal
import socket
import struct
import threading
import time

import httpx
import pytest

from server.sse import EventStream
from server.wire_format import WireFormat
from server_process import ServerProcess
from test_server import TINY, metric

@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    with ServerProcess(tiny_checkpoint("qwen3", **TINY), "--max-concurrency", "4") as srv:
        yield srv


def _stream_text(url: str, body: dict) -> str:
    with httpx.stream("POST", url + "/v1/completions", json=body | {"stream": True},
                      timeout=120) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: {")]
    return "".join(c["choices"][0]["text"] for c in chunks)


def _wait_idle(url: str, timeout: float = 15.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        table = httpx.get(url + "/v1/requests").json()
        if not table["data"] or time.monotonic() > deadline:
            return table
        time.sleep(0.05)


def _metrics(url: str) -> str:
    return httpx.get(url + "/metrics").text


CANCELLED = 'pagedserve:request_finished_total{finished_reason="cancelled"}'


def _cancelled(url: str) -> float:
    try:
        return metric(_metrics(url), CANCELLED)
    except KeyError:
        return 0.0


def _raw_stream(port: int, body: dict, headers: str = "") -> socket.socket:
    """A hand-made HTTP client, to read (or not read) at its own pace."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)    # a small window: a stall shows soon
    sock.connect(("127.0.0.1", port))
    payload = json.dumps(body | {"stream": True}).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n%s"
                 b"Content-Length: %d\r\n\r\n%s" % (headers.encode(), len(payload), payload))
    return sock


LONG = {"prompt": "The quick brown fox", "max_tokens": 240, "temperature": 0, "ignore_eos": True}


def test_disconnect_mid_stream_frees_everything(server):
    before, tokens_before = _cancelled(server.url), metric(_metrics(server.url),
                                                           "pagedserve:generation_tokens_total")
    with httpx.stream("POST", server.url + "/v1/completions", json=LONG | {"stream": True},
                      timeout=60) as r:
        lines = r.iter_lines()
        for _ in range(3):
            next(line for line in lines if line.startswith("data: {"))
    assert _wait_idle(server.url)["data"] == []
    text = _metrics(server.url)
    assert metric(text, "pagedserve:kv_cache_usage_perc") == 0
    assert metric(text, "pagedserve:num_requests_running") == 0
    assert metric(text, CANCELLED) == before + 1
    assert metric(text, "pagedserve:generation_tokens_total") - tokens_before < LONG["max_tokens"]


def _hang_up(port: int, how: int, seed: int) -> None:
    """Open a stream and leave: right after the request, after the headers, mid-stream, or with a
    TCP reset (SO_LINGER 0)."""
    rng = random.Random(seed)
    sock = _raw_stream(port, LONG | {"max_tokens": 200, "prompt": "fox " * rng.randint(1, 40)})
    if how >= 1:
        sock.recv(100)
    if how == 2:
        for _ in range(rng.randint(1, 20)):
            sock.recv(200)
    if how == 3:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def test_every_stream_handler_ends_when_clients_hang_up(server):
    """128 clients leave at random points; every SSE handler must end, not go on sending keep-alives
    to a gone client (seen before: a sender that missed its cancel ran until shutdown killed it)."""
    for round_ in range(4):
        threads = [threading.Thread(target=_hang_up, args=(server.port, i % 4, 32 * round_ + i))
                   for i in range(32)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
    assert _wait_idle(server.url)["data"] == []
    deadline = time.monotonic() + 30        # a bound on the wait, not a measured speed
    while metric(_metrics(server.url), "pagedserve:http_streams_open") and time.monotonic() < deadline:
        time.sleep(0.05)
    text = _metrics(server.url)
    assert metric(text, "pagedserve:http_streams_open") == 0
    assert metric(text, "pagedserve:kv_cache_usage_perc") == 0


def _three_streams(url: str) -> list[str]:
    texts: list[str] = [""] * 3

    def run(i: int) -> None:
        texts[i] = _stream_text(url, LONG | {"max_tokens": 48, "prompt": f"fox {i}"})
    threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return texts


def test_slow_reader_does_not_slow_the_others(server):
    """A client that reads nothing holds a long stream; three others still get every token, the same
    ones as without it, while it stays live. (If the engine waited for the slow client, they would
    not finish: the wait is bounded by the client timeout, never asserted as a speed.)"""
    alone = _three_streams(server.url)
    slow = _raw_stream(server.port, LONG | {"logprobs": 20, "prompt": "The slow reader"})
    deadline = time.monotonic() + 30
    while not httpx.get(server.url + "/v1/requests").json()["data"] and time.monotonic() < deadline:
        time.sleep(0.02)
    beside_slow = _three_streams(server.url)
    live = [(r["client"], r["state"]) for r in httpx.get(server.url + "/v1/requests").json()["data"]]
    slow.close()
    assert beside_slow == alone and all(alone)          # the same texts, every one complete
    assert len(live) == 1 and live[0][1] in ("decode", "paused"), live   # the slow stream, still held
    assert _wait_idle(server.url)["data"] == []


def test_stalled_client_is_dropped_after_the_write_timeout():
    """A socket that never drains: loopback buffers hold megabytes, more than a tiny model writes,
    so the stall is made here, at the ASGI `send` the server awaits."""
    closed: list[str] = []

    async def events():
        try:
            while True:
                yield b"data: {}\n\n"
        finally:                            # Generation's own `finally` cancels the request here
            closed.append("events")

    async def never(*_):
        await asyncio.Event().wait()

    async def send(message):
        if message["type"] == "http.response.body":
            closed.append("send")
            try:
                await never()
            except asyncio.CancelledError:      # what the write timeout does to a stalled send
                closed.append("send timed out")
                raise

    async def run() -> None:
        stream = EventStream(events(), WireFormat("id", "model", None),
                             on_close=lambda: closed.append("on_close"), send_timeout_s=0.3, keepalive_s=1.0)
        await asyncio.wait_for(stream({"type": "http"}, never, send), 10)   # a bound, not a speed
    asyncio.run(run())
    assert closed == ["send", "send timed out", "events", "on_close"]


def test_concurrent_greedy_streams_match_each_alone(server):
    prompts = [[(7 * i + 13 * j) % 400 + 3 for j in range(5 + i)] for i in range(16)]
    body = {"max_tokens": 8, "temperature": 0, "ignore_eos": True}
    alone = [_stream_text(server.url, body | {"prompt": p}) for p in prompts]
    together: list[str | None] = [None] * len(prompts)

    def run(i: int) -> None:
        together[i] = _stream_text(server.url, body | {"prompt": prompts[i]})
    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert together == alone and len(set(alone)) > 1


def test_sigterm_drains_queued_503_running_finish_exit_0(server):
    """Runs last: it ends the module's server."""
    results: dict[int, httpx.Response] = {}

    def ask(i: int) -> None:
        results[i] = httpx.post(server.url + "/v1/completions", timeout=120,
                                json=LONG | {"prompt": f"fox {i}"})

    def stats_become(want: tuple[int, int]) -> tuple[int, int]:
        deadline = time.monotonic() + 30
        while True:
            stats = httpx.get(server.url + "/v1/requests").json()["stats"]
            if (stats["running"], stats["waiting"]) == want or time.monotonic() > deadline:
                return stats["running"], stats["waiting"]
            time.sleep(0.01)

    # the last three are sent once the first four run (all seven at once, on a loaded machine the first
    # four sometimes finished before the others were in); their 240 tokens leave time for three posts
    threads = [threading.Thread(target=ask, args=(i,)) for i in range(7)]
    for t in threads[:4]:
        t.start()
    assert stats_become((4, 0)) == (4, 0)
    for t in threads[4:]:
        t.start()
    assert stats_become((4, 3)) == (4, 3)
    server.proc.send_signal(signal.SIGTERM)
    for t in threads:
        t.join(60)
    assert server.proc.wait(60) == 0, server.output()
    statuses = sorted(r.status_code for r in results.values())
    assert statuses == [200] * 4 + [503] * 3
    for r in results.values():
        if r.status_code == 200:
            assert r.json()["usage"]["completion_tokens"] == LONG["max_tokens"]
        else:
            assert r.json()["error"]["code"] == "shutting_down"
