"""The interface between one completion's deltas and an API's wire format (OpenAI chat or text
completions, Anthropic messages, OpenAI responses, llama.cpp's infill): server/generation.py
reads the engine, a WireFormat says what the client receives."""
from __future__ import annotations

import time

from engine.output import Delta


class WireFormat:
    """- `opening()`, `events(index, delta)`, `closing(last, include_usage)`: the SSE events of a
      stream, before any delta, for each choice's delta, and after the last (`last`: every choice's
      final delta, which carries the token counts); `error_event(error)` ends a failed stream;
    - `whole(totals)`: the body of a non-streamed answer, one merged Delta per choice;
    - `KEEPALIVE`: what a stream sends while it has nothing to say; `MEDIA_TYPE`: its content type.
    """
    KEEPALIVE = b": keep-alive\n\n"
    MEDIA_TYPE = "text/event-stream; charset=utf-8"

    def __init__(self, request_id: str, model: str, tokenizer, want_logprobs: bool = False):
        self.id = request_id
        self.model = model
        self.created = int(time.time())
        self._tokenizer = tokenizer
        self.want_logprobs = want_logprobs

    def opening(self) -> list[bytes]:
        return []

    def events(self, index: int, delta: Delta) -> list[bytes]:
        raise NotImplementedError

    def closing(self, last: list[Delta], include_usage: bool) -> list[bytes]:
        return []

    def error_event(self, error) -> bytes:
        raise NotImplementedError

    def whole(self, totals: list[Delta]) -> dict:
        raise NotImplementedError
