"""Anthropic's Messages API on the wire: a whole `message` with content blocks (thinking, text,
tool_use), or its stream of events (message_start, content_block_start/delta/stop, message_delta,
message_stop, and ping while there is nothing to say)."""
from __future__ import annotations

from engine.output import Delta
from engine.request import FinishReason
from server.anthropic_schemas import dumps_input
from server.chat_output import ChatOutput, ChatPiece, whole_calls
from server.sse import sse_event
from server.wire_format import WireFormat


def _event(payload: dict) -> bytes:
    return sse_event(payload, event=payload["type"])


def _tool_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


def _usage(delta: Delta) -> dict:
    """Anthropic's split of the prompt: `input_tokens` computed, `cache_read_input_tokens` read from
    the prefix cache (which every prompt fills on its own, so nothing counts as a cache write)."""
    return {"input_tokens": delta.prompt_tokens - delta.cached_tokens, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": delta.cached_tokens, "output_tokens": delta.completion_tokens}


class MessageFormat(WireFormat):
    KEEPALIVE = _event({"type": "ping"})

    def __init__(self, request_id: str, model: str, tokenizer, output: ChatOutput, input_tokens: int):
        super().__init__(request_id, model, tokenizer)
        self.output = output
        self.input_tokens = input_tokens
        self._open: str | None = None   # the streamed block that is open: "thinking", "text", "tool_use"
        self._blocks = 0                # blocks started so far (the next one's index)

    def _stop_reason(self, delta: Delta) -> str:
        if delta.finish_reason in (FinishReason.LENGTH, FinishReason.TIMEOUT):
            return "max_tokens"
        if delta.stop_sequence is not None:
            return "stop_sequence"
        return "tool_use" if self.output.called else "end_turn"

    def _message(self, content: list, stop_reason: str | None, stop_sequence: str | None, usage: dict) -> dict:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
                "content": content, "stop_reason": stop_reason, "stop_sequence": stop_sequence, "usage": usage}

    def whole(self, totals: list[Delta]) -> dict:
        total = totals[0]
        piece = self.output.feed(total.text, final=True)
        content = []
        if piece.reasoning:
            content.append({"type": "thinking", "thinking": piece.reasoning, "signature": ""})
        if piece.content:
            content.append({"type": "text", "text": piece.content})
        content += [{"type": "tool_use", "id": _tool_id(c["id"]), "name": c["function"]["name"],
                     "input": dumps_input(c["function"]["arguments"])} for c in whole_calls(piece.tool_calls)]
        return self._message(content, self._stop_reason(total), total.stop_sequence, _usage(total))

    # ---- streaming
    def opening(self) -> list[bytes]:
        # the prompt may not be admitted yet: what the cache held comes with message_delta
        usage = _usage(Delta(prompt_tokens=self.input_tokens))
        return [_event({"type": "message_start", "message": self._message([], None, None, usage)})]

    def events(self, index: int, delta: Delta) -> list[bytes]:
        out = self._piece(self.output.feed(delta.text, final=delta.finish_reason is not None))
        if delta.finish_reason is not None:
            out += self._close()
            out.append(_event({"type": "message_delta",
                               "delta": {"stop_reason": self._stop_reason(delta),
                                         "stop_sequence": delta.stop_sequence},
                               "usage": _usage(delta)}))
        return out

    def closing(self, last: list[Delta], include_usage: bool) -> list[bytes]:
        return [_event({"type": "message_stop"})]

    def error_event(self, error) -> bytes:
        return _event(error.anthropic_body())

    def _piece(self, piece: ChatPiece) -> list[bytes]:
        out: list[bytes] = []
        if piece.reasoning:
            out += self._start("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            out.append(self._delta({"type": "thinking_delta", "thinking": piece.reasoning}))
        if piece.content:
            out += self._start("text", {"type": "text", "text": ""})
            out.append(self._delta({"type": "text_delta", "text": piece.content}))
        for call in piece.tool_calls:
            if call.id is not None:     # a new call: a block of its own
                out += self._start("tool_use", {"type": "tool_use", "id": _tool_id(call.id),
                                                "name": call.name, "input": {}})
            if call.arguments:
                out.append(self._delta({"type": "input_json_delta", "partial_json": call.arguments}))
        return out

    def _start(self, kind: str, block: dict) -> list[bytes]:
        if self._open == kind and kind != "tool_use":
            return []
        out = self._close()
        self._open = kind
        self._blocks += 1
        return out + [_event({"type": "content_block_start", "index": self._blocks - 1,
                              "content_block": block})]

    def _delta(self, delta: dict) -> bytes:
        return _event({"type": "content_block_delta", "index": self._blocks - 1, "delta": delta})

    def _close(self) -> list[bytes]:
        if self._open is None:
            return []
        self._open = None
        return [_event({"type": "content_block_stop", "index": self._blocks - 1})]
