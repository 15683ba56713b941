"""Reading one request's deltas for HTTP: latency metrics as the client sees them, then either SSE
chunks or one whole answer. A request that ends here for any reason (disconnect, error, shutdown)
is cancelled in the engine and leaves the server's table."""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from engine.loop import Delta
from engine.request import FinishReason
from engine.server.engine_host import EngineHost
from engine.server.errors import APIError
from engine.server.sse import sse_event, wait_for_disconnect


class Generation:
    def __init__(self, host: EngineHost, handle, fmt, *, want_logprobs: bool):
        self.host = host
        self.handle = handle
        self.fmt = fmt
        self.want_logprobs = want_logprobs
        self._arrival = time.monotonic()
        self._last_token: float | None = None
        self._shed = False          # cancelled by shutdown before it started: answered 503

    async def deltas(self) -> AsyncIterator[Delta]:
        """The handle's deltas, timed; cancels the request if the reader stops early."""
        metrics, finished = self.host.metrics, False
        try:
            async for delta in self.handle:
                now, n = time.monotonic(), len(delta.token_ids)
                if n and self._last_token is None:
                    metrics.ttft.observe(now - self._arrival)
                elif n:
                    for _ in range(n):      # a merged delta: its tokens shared the wait
                        metrics.itl.observe((now - self._last_token) / n)
                self._last_token = now if n else self._last_token
                if delta.finish_reason is not None:
                    finished = True
                    self._shed = self.handle.id in self.host.shed   # before release forgets it
                    metrics.finished.labels(delta.finish_reason.value).inc()
                    metrics.e2e.observe(now - self._arrival)
                yield delta
        finally:
            if not finished:                # the client left (or stalled) before the end
                self.handle.cancel()
                metrics.finished.labels("cancelled").inc()
            self.host.release(self.handle.id)

    def _failure(self, delta: Delta) -> APIError | None:
        if delta.finish_reason is FinishReason.CANCELLED and self._shed:
            return APIError(503, "the server is shutting down; the request was not started",
                            code="shutting_down")
        if delta.finish_reason is FinishReason.ERROR:
            return APIError(500, f"the engine failed this request: {delta.error}",
                            type="server_error", code="engine_error")
        return None

    async def whole(self, receive) -> dict:
        """The complete answer; a client that disconnects meanwhile cancels it."""
        total = Delta()

        async def collect() -> None:
            async for delta in self.deltas():
                total.merge(delta)

        work = asyncio.ensure_future(collect())
        gone = asyncio.ensure_future(wait_for_disconnect(receive))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (work, gone):
                task.cancel()
            await asyncio.gather(work, gone, return_exceptions=True)
        if work.done() and not work.cancelled() and work.exception() is not None:
            raise work.exception()
        if total.finish_reason is None:
            raise APIError(499, "client closed the request", code="client_closed")
        failure = self._failure(total)
        if failure is not None:
            raise failure
        return self.fmt.whole(total.text, total.logprobs, total.finish_reason, self.want_logprobs,
                              total.prompt_tokens, total.completion_tokens)

    async def events(self, include_usage: bool) -> AsyncIterator[bytes]:
        """SSE chunks, the usage chunk if asked, then `data: [DONE]`."""
        first = self.fmt.role_chunk()
        if first is not None:
            yield sse_event(first)
        last = Delta()
        async for delta in self.deltas():
            last = delta
            failure = self._failure(delta)
            if failure is not None:
                yield sse_event(failure.body())
                break
            if delta.text or delta.finish_reason is not None or (self.want_logprobs and delta.logprobs):
                yield sse_event(self.fmt.chunk(delta.text, delta.logprobs, delta.finish_reason,
                                               self.want_logprobs))
        if include_usage:
            yield sse_event(self.fmt.usage_chunk(last.prompt_tokens, last.completion_tokens))
        yield sse_event("[DONE]")
