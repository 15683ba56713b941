"""uvicorn's h11 protocol with a deadline on request headers. A client that sends its headers a byte
at a time (slowloris) resets uvicorn's idle timer with every byte and so holds its connection for
as long as it likes; here a request whose headers are not complete within `header_timeout_s` of
the connection opening (or of the previous response ending) has its connection closed."""
from __future__ import annotations

import asyncio

from uvicorn.protocols.http.h11_impl import H11Protocol


def header_deadline_protocol(header_timeout_s: float) -> type[H11Protocol]:
    class HeaderDeadline(H11Protocol):
        _deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.cycle is not None and not self.cycle.response_complete and self._deadline:
                self._deadline.cancel()     # the headers are in: the request is being served
                self._deadline = None

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm()                     # the next request on this connection gets the same time

        def connection_lost(self, exc) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
            super().connection_lost(exc)

        def _arm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
            self._deadline = self.loop.call_later(header_timeout_s, self._too_slow)

        def _too_slow(self) -> None:
            self._deadline = None
            if self.cycle is None or self.cycle.response_complete:
                self.transport.close()

    return HeaderDeadline
