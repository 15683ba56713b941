"""Ollama's answers on the wire: one JSON object (`stream: false`), or newline-delimited JSON objects,
each a piece of the reply with `done: false`, then one with `done: true`, `done_reason` and the
token counts and durations (nanoseconds). /api/chat puts its pieces in `message` (`content`,
`thinking`, and `tool_calls` with their arguments as objects, each call sent once it is complete);
/api/generate in `response` (and `thinking`)."""
from __future__ import annotations

import json
import time
from datetime import datetime, timezone

from engine.output import Delta
from engine.request import FinishReason
from server.anthropic_schemas import dumps_input
from server.chat_output import ChatOutput, ChatPiece, whole_calls
from server.tool_call_parser import ToolCallDelta
from server.wire_format import WireFormat


def ndjson_line(payload: dict) -> bytes:
    return (json.dumps(payload, ensure_ascii=False, separators=(",", ":")) + "\n").encode()


def created_at() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _ns(seconds: float) -> int:
    return max(0, int(seconds * 1e9))


class _Format(WireFormat):
    KEEPALIVE = b""                 # every NDJSON line is parsed: nothing is sent while queued
    MEDIA_TYPE = "application/x-ndjson"

    def __init__(self, request_id: str, model: str, tokenizer, output: ChatOutput | None):
        super().__init__(request_id, model, tokenizer)
        self.output = output        # None: the reply is text as it comes (raw and FIM prompts)
        self._start = time.monotonic()
        self._first: float | None = None    # the first and last tokens' times (the engine's clock)
        self._last: float | None = None
        self._calls: list[ToolCallDelta] = []      # the reply's call deltas so far

    def _split(self, delta: Delta) -> ChatPiece:
        if delta.token_times:
            self._first = delta.token_times[0] if self._first is None else self._first
            self._last = delta.token_times[-1]
        if self.output is None:
            return ChatPiece(content=delta.text)
        piece = self.output.feed(delta.text, final=delta.finish_reason is not None)
        self._calls += piece.tool_calls
        return piece

    def _tool_calls(self) -> list[dict]:
        return [{"function": {"name": c["function"]["name"], "arguments": dumps_input(c["function"]["arguments"])}}
                for c in whole_calls(self._calls)]

    def _done(self, delta: Delta) -> dict:
        """The last object's fields: why it ended, the counts, the durations (prompt: until the first
        token; eval: from it to the last)."""
        now = time.monotonic()
        first = self._first if self._first is not None else now
        last = self._last if self._last is not None else first
        cut = delta.finish_reason in (FinishReason.LENGTH, FinishReason.TIMEOUT)
        return {"done": True, "done_reason": "length" if cut else "stop", "total_duration": _ns(now - self._start),
                "load_duration": 0, "prompt_eval_count": delta.prompt_tokens,
                "prompt_eval_duration": _ns(first - self._start), "eval_count": delta.completion_tokens,
                "eval_duration": _ns(last - first)}

    def _object(self, piece: ChatPiece, **fields) -> dict:
        raise NotImplementedError

    def events(self, index: int, delta: Delta) -> list[bytes]:
        piece = self._split(delta)
        out = [self._object(piece)] if piece.content or piece.reasoning else []
        if delta.finish_reason is not None:
            if self._calls:     # as Ollama sends them: in an object of their own before the last
                out.append(self._object(ChatPiece(), calls=True))
            out.append(self._object(ChatPiece()) | self._done(delta))
        return [ndjson_line(o if "done" in o else o | {"done": False}) for o in out]

    def error_event(self, error) -> bytes:
        return ndjson_line(error.ollama_body())

    def whole(self, totals: list[Delta]) -> dict:
        total = totals[0]
        return self._object(self._split(total), calls=True) | self._done(total)


class ChatFormat(_Format):

    def _object(self, piece: ChatPiece, calls: bool = False) -> dict:
        message: dict = {"role": "assistant", "content": piece.content}
        if piece.reasoning:
            message["thinking"] = piece.reasoning
        if calls and self._calls:
            message["tool_calls"] = self._tool_calls()
        return {"model": self.model, "created_at": created_at(), "message": message}


class GenerateFormat(_Format):
    def _object(self, piece: ChatPiece, calls: bool = False) -> dict:
        body = {"model": self.model, "created_at": created_at(), "response": piece.content}
        return body | ({"thinking": piece.reasoning} if piece.reasoning else {})
