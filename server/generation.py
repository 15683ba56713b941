"""Reading one completion's deltas for HTTP (one engine request per choice): latency metrics from
the engine's own token times, then either SSE chunks or one whole answer. A completion that ends
here for any reason (disconnect, error, shutdown) has its unfinished choices cancelled in the
engine."""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from fastapi.responses import JSONResponse

from engine.output import Delta
from engine.request import FinishReason
from server.engine_host import SHED, EngineHost
from server.errors import APIError
from server.sse import EventStream, wait_for_disconnect


class Generation:
    def __init__(self, host: EngineHost, completion_id: str, handles: list, fmt):
        self.host = host
        self.id = completion_id
        self.handles = handles
        self.fmt = fmt                  # server/wire_format.py WireFormat
        self._last_token: list[float | None] = [None] * len(handles)
        self._finished = [False] * len(handles)

    def _observe(self, index: int, delta: Delta) -> None:
        """TTFT and ITL from when the engine produced each token (engine/output.py records them),
        so a merged delta still counts each token's own gap."""
        metrics, arrival = self.host.metrics, self.handles[index].request.arrival_time
        last = self._last_token[index]
        for t in delta.token_times:
            if last is None:
                metrics.ttft.observe(t - arrival)
            else:
                metrics.itl.observe(t - last)
            last = t
        self._last_token[index] = last
        if delta.finish_reason is not None:
            self._finished[index] = True
            metrics.finished.labels(delta.finish_reason.value).inc()
            metrics.e2e.observe(time.monotonic() - arrival)

    def close(self) -> None:
        """Cancel the choices that have not finished (the reader stopped early); safe to repeat."""
        for i, (handle, finished) in enumerate(zip(self.handles, self._finished)):
            if not finished:
                self._finished[i] = True
                handle.cancel()
                self.host.metrics.finished.labels("cancelled").inc()

    async def _merged(self) -> AsyncIterator[tuple[int, Delta]]:
        if len(self.handles) == 1:      # the common case pays for no tasks
            async for delta in self.handles[0]:
                yield 0, delta
            return
        streams = [h.__aiter__() for h in self.handles]
        pending = {asyncio.ensure_future(anext(s)): i for i, s in enumerate(streams)}
        try:
            while pending:
                done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in sorted(done, key=pending.get):
                    i = pending.pop(task)
                    delta = task.result()
                    yield i, delta
                    if delta.finish_reason is None:
                        pending[asyncio.ensure_future(anext(streams[i]))] = i
        finally:
            for task in pending:
                task.cancel()

    async def deltas(self) -> AsyncIterator[tuple[int, Delta]]:
        """Every choice's deltas as they come, timed; cancels what is unfinished if the reader
        stops early."""
        try:
            async for index, delta in self._merged():
                self._observe(index, delta)
                yield index, delta
        finally:
            self.close()

    def _failure(self, delta: Delta) -> APIError | None:
        if delta.finish_reason is FinishReason.CANCELLED and delta.error == SHED:
            return APIError(503, SHED, code="shutting_down")
        if delta.finish_reason is FinishReason.CANCELLED:     # the operator's DELETE /v1/requests/{id}
            return APIError(503, f"the request was cancelled on the server after {delta.completion_tokens} "
                                 f"generated tokens{': ' + delta.error if delta.error else ''}",
                            code="cancelled")
        if delta.finish_reason is FinishReason.ERROR:
            return APIError(500, f"the engine failed this request: {delta.error}",
                            type="server_error", code="engine_error")
        return None

    async def whole(self, receive) -> dict:
        """The complete answer; a client that disconnects meanwhile cancels it."""
        totals = [Delta() for _ in self.handles]

        async def collect() -> None:
            async for index, delta in self.deltas():
                totals[index].merge(delta)

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
        if any(t.finish_reason is None for t in totals):
            raise APIError(499, "client closed the request", code="client_closed")
        for total in totals:
            failure = self._failure(total)
            if failure is not None:
                raise failure
        return self.fmt.whole(totals)

    async def events(self, include_usage: bool = False) -> AsyncIterator[bytes]:
        """The format's SSE events: its opening, each delta's, an error that ends the stream, and
        its closing."""
        for event in self.fmt.opening():
            yield event
        last = [Delta() for _ in self.handles]
        async for index, delta in self.deltas():
            last[index] = delta
            failure = self._failure(delta)
            if failure is not None:
                yield self.fmt.error_event(failure)
                break
            for event in self.fmt.events(index, delta):
                yield event
        for event in self.fmt.closing(last, include_usage):
            yield event


async def answer(request, host: EngineHost, fmt, completion_id: str, handles: list, *, stream: bool,
                 include_usage: bool = False):
    """The completion's answer in `fmt`: a stream of its events, or one JSON body once it is done."""
    generation = Generation(host, completion_id, handles, fmt)
    if stream:
        return EventStream(generation.events(include_usage), fmt, on_close=generation.close,
                           send_timeout_s=host.engine_cfg.client_timeout_s,
                           keepalive_s=host.server_cfg.sse_keepalive_s, open_streams=host.metrics.open_streams)
    return JSONResponse(await generation.whole(request.receive))
