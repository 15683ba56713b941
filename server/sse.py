"""Server-sent events for one streamed request, written against raw ASGI.

Three things run together: the producer (the request's events, through a small bounded queue so a
slow socket stops the producer, the engine's buffer grows and the engine pauses only this request),
the sender (with `: keep-alive` comments while nothing is ready, and a timeout on each write so a
stalled client is dropped), and the disconnect watcher (a closed connection ends everything at
once). Whatever ends the stream, `on_close` runs, which cancels the request if it is still live.

The sender also stops on a flag, not on cancellation alone: Python 3.11's `asyncio.wait_for` can
swallow a cancel that lands as its inner wait completes, and a sender that missed it went on
sending keep-alives to a gone client until the server's shutdown cancelled it by force.
"""
from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from server.errors import APIError

_QUEUE_EVENTS = 4       # more would hide a slow reader from the engine's pause policy
_DONE = object()


# JSON may carry these raw, but clients that split lines like str.splitlines (httpx's iter_lines)
# end an SSE line at them and then cannot parse either half: escaped, the JSON means the same
_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def sse_event(payload: dict | str, event: str | None = None) -> bytes:
    """One server-sent event: `data:` the JSON payload (or text), after `event:` if named."""
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False,
                                                               separators=(",", ":")).translate(_LINE_BREAKS)
    named = f"event: {event}\n" if event else ""
    return f"{named}data: {data}\n\n".encode()


async def wait_for_disconnect(receive: Receive) -> None:
    """Returns when the client has gone (the request body must already be read)."""
    while (await receive())["type"] != "http.disconnect":
        pass


class EventStream(Response):
    """`fmt` (server/wire_format.py) gives the content type, the keep-alive and the event that ends a
    stream whose producer failed."""

    def __init__(self, events: AsyncIterator[bytes], fmt, *, on_close: Callable[[], None],
                 send_timeout_s: float, keepalive_s: float, open_streams=None):
        # no Response.__init__: it would announce content-length 0 for a body it does not know
        self.status_code = 200
        self.background = None
        self.raw_headers = [(b"content-type", fmt.MEDIA_TYPE.encode()),
                            (b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]
        self._events = events
        self._fmt = fmt
        self._on_close = on_close
        self._send_timeout_s = send_timeout_s
        self._keepalive_s = keepalive_s     # short, so clients and proxies with read timeouts see
        self._keepalive = fmt.KEEPALIVE     # life while queued
        self._open_streams = open_streams   # a gauge (inc/dec) of the streams being served, or None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        queue: asyncio.Queue = asyncio.Queue(maxsize=_QUEUE_EVENTS)
        closing = asyncio.Event()

        async def produce() -> None:
            try:
                async for event in self._events:
                    await queue.put(event)
            except Exception as exc:  # noqa: BLE001 - a bug must still end the stream cleanly
                await queue.put(self._fmt.error_event(APIError(500, f"internal error: {exc}")))
            await queue.put(_DONE)

        async def deliver() -> None:
            await send({"type": "http.response.start", "status": self.status_code,
                        "headers": self.raw_headers})
            while not closing.is_set():
                try:
                    event = await asyncio.wait_for(queue.get(), self._keepalive_s)
                except TimeoutError:
                    event = self._keepalive
                if event is _DONE:
                    break
                await asyncio.wait_for(send({"type": "http.response.body", "body": event,
                                             "more_body": True}), self._send_timeout_s)
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        tasks = [asyncio.create_task(produce()), asyncio.create_task(deliver()),
                 asyncio.create_task(wait_for_disconnect(receive))]
        if self._open_streams is not None:
            self._open_streams.inc()
        try:
            # the sender finishing, failing (client gone, write timed out) or a disconnect ends it
            await asyncio.wait(tasks[1:], return_when=asyncio.FIRST_COMPLETED)
        finally:
            closing.set()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self._events.aclose()
            self._on_close()
            if self._open_streams is not None:
                self._open_streams.dec()
