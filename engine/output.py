"""One request's record above the scheduler (RequestHandle) and what its readers get out of it:
Delta (what arrived since the last read) and Completion (the whole answer)."""
from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from engine.detokenize import IncrementalDetokenizer
from engine.request import FinishReason, Request


@dataclass
class Delta:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[tuple] = field(default_factory=list)   # (token, logprob, top) per token
    finish_reason: FinishReason | None = None
    error: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0              # of prompt_tokens, those read from the prefix cache
    stop_sequence: str | None = None    # the stop string that ended it (finish_reason STOP)
    token_times: list[float] = field(default_factory=list)   # when the engine produced each token

    def merge(self, later: "Delta") -> None:
        self.text += later.text
        self.token_ids += later.token_ids
        self.logprobs += later.logprobs
        self.token_times += later.token_times
        self.finish_reason, self.error = later.finish_reason, later.error
        self.stop_sequence = later.stop_sequence
        self.prompt_tokens, self.completion_tokens = later.prompt_tokens, later.completion_tokens
        self.cached_tokens = later.cached_tokens


@dataclass
class Completion:
    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None
    prompt_tokens: int
    error: str | None = None
    logprobs: list[tuple] = field(default_factory=list)
    cached_tokens: int = 0              # of prompt_tokens, those read from the prefix cache


class RequestHandle:
    """The one record of a live request above the scheduler: the request, its detokenizer and stop
    matcher, its output buffer and deadline. The loop owns it and writes the buffer; readers (the
    server, the console, the offline API) iterate it, and read its timings from `request`
    (arrival, first and last token, all on the engine's clock)."""

    def __init__(self, loop, request: Request, detok: IncrementalDetokenizer, *, bounded: bool,
                 group: str | None = None, deadline: float | None = None):
        self.id = request.id
        self.request = request
        self.detok = detok
        self.bounded = bounded
        self.group = group or request.id   # a completion's choices share their first choice's id
        self.deadline = deadline            # monotonic time after which it stops (FinishReason.TIMEOUT)
        self._loop = loop
        self._pending: deque[Delta] = deque()
        self._cond = threading.Condition()
        self._done = False
        self._unread_tokens = 0
        self.last_read = time.monotonic()
        self._aio: tuple[asyncio.AbstractEventLoop, asyncio.Event] | None = None

    # -- loop side
    def _push(self, delta: Delta) -> None:
        with self._cond:
            if not self._pending:   # the stall clock runs from when output waits, not from submit
                self.last_read = time.monotonic()
            self._pending.append(delta)
            self._unread_tokens += len(delta.token_ids)
            self._done = self._done or delta.finish_reason is not None
            self._cond.notify_all()
            aio = self._aio
        if aio is not None:
            aio[0].call_soon_threadsafe(aio[1].set)

    @property
    def lag(self) -> int:
        return self._unread_tokens

    @property
    def finished(self) -> bool:
        """The final delta is in the buffer (it may not have been read yet)."""
        return self._done

    # -- reader side
    def _take(self) -> Delta | None:
        if not self._pending:
            return None
        out = self._pending.popleft()
        while self._pending:
            out.merge(self._pending.popleft())
        self._unread_tokens = 0
        self.last_read = time.monotonic()
        return out

    def __iter__(self):
        while True:
            with self._cond:
                while not self._pending:
                    self._cond.wait()
                delta = self._take()
            self._loop.wake()
            yield delta
            if delta.finish_reason is not None:
                return

    async def __aiter__(self):
        with self._cond:
            self._aio = (asyncio.get_running_loop(), asyncio.Event())
        while True:
            event = self._aio[1]
            with self._cond:
                delta = self._take()
                if delta is None:
                    event.clear()
            if delta is None:
                await event.wait()
                continue
            self._loop.wake()
            yield delta
            if delta.finish_reason is not None:
                return

    def result(self) -> Completion:
        total = Delta()
        for delta in self:
            total.merge(delta)
        return Completion(total.text, total.token_ids, total.finish_reason, total.prompt_tokens,
                          total.error, total.logprobs, total.cached_tokens)

    def cancel(self) -> None:
        self._loop.cancel(self.id)
