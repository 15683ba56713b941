"""A scripted ConsoleClient for the console tests: replies can be held mid-generation, requests
show up in snapshots like an engine's, and cancels are recorded. No tests here."""
from __future__ import annotations

import asyncio
import itertools
import threading

from console.client import EngineSnapshot, ReplyDelta
from engine.stats import RequestRow


class FakeReply:
    def __init__(self, client: FakeClient, rid: str, label: str, tokens: list[str], hold_after: int | None):
        self.id, self.label = rid, label
        self._client, self._tokens, self._hold_after = client, tokens, hold_after
        self.released = threading.Event()
        self.cancelled = threading.Event()
        self.sent = 0

    def __iter__(self):
        try:
            for i, token in enumerate(self._tokens):
                if i == self._hold_after:
                    while not (self.released.is_set() or self.cancelled.is_set()):
                        self.released.wait(0.01)
                if self.cancelled.is_set():
                    yield ReplyDelta(finish_reason="cancelled", completion_tokens=self.sent)
                    return
                self.sent += 1
                yield ReplyDelta(token, completion_tokens=self.sent)
            yield ReplyDelta(finish_reason="stop", completion_tokens=self.sent)
        finally:
            self._client.live.pop(self.id, None)

    def cancel(self) -> None:
        self._client.cancelled.append(self.id)
        self.cancelled.set()


class FakeClient:
    """Reply n (counting from 0) is `reply(n)` split into words; with `hold_after=k` every reply
    stops after k tokens until `release(id)` (or a cancel)."""

    def __init__(self, hold_after: int | None = None, words: int = 6):
        self.hold_after, self.words = hold_after, words
        self._ids = itertools.count()
        self.live: dict[str, FakeReply] = {}
        self.requests: list[dict] = []
        self.cancelled: list[str] = []
        self.closed = False

    @staticmethod
    def reply(n: int, words: int = 6) -> str:
        return " ".join(f"w{n}.{i}" for i in range(words))

    def connect(self, progress) -> str:
        progress(5, 10)
        return "fake-model · test"

    def stream(self, messages, *, temperature, max_tokens, client):
        n = next(self._ids)
        rid = f"req-{n}"
        self.requests.append({"messages": messages, "temperature": temperature,
                              "max_tokens": max_tokens, "client": client, "id": rid})
        text = self.reply(n, self.words)
        tokens = [w + " " for w in text.split(" ")]
        tokens[-1] = tokens[-1].rstrip()
        self.live[rid] = FakeReply(self, rid, client, tokens, self.hold_after)
        return self.live[rid]

    def release(self, rid: str) -> None:
        self.live[rid].released.set()

    def cancel(self, request_id: str) -> None:
        if request_id in self.live:
            self.live[request_id].cancel()

    def snapshot(self) -> EngineSnapshot:
        rows = tuple(RequestRow(r.id, "decode", 10, r.sent, 2, None, 1.0, r.label, 3.0)
                     for r in list(self.live.values()))
        return EngineSnapshot(running=len(rows), blocks_used=2 * len(rows), blocks_total=64,
                              generation_tokens_per_s=6.0, ttft_p50_s=0.05, itl_p50_s=0.01,
                              itl_p99_s=0.02, requests=rows)

    def close(self) -> None:
        self.closed = True


async def until(pilot, condition, timeout: float = 5.0) -> None:
    """Let the app run until `condition()` holds; fail after `timeout` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not condition():
        assert loop.time() < deadline, "condition not reached in time"
        await pilot.pause(0.02)
