"""OpenAI's Responses API on the wire: a whole `response` object with its output items (reasoning,
an assistant message, function calls), or the stream of events that builds it, each with a
`sequence_number`: response.created / in_progress, then per item output_item.added, its content
part or arguments deltas and their .done events, output_item.done, and response.completed (or
response.incomplete, or an error event and response.failed). The finished response object goes
to `keep` (server/response_store.py) where the request asked to store it."""
from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from engine.output import Delta
from engine.request import FinishReason
from server.chat_output import ChatOutput, ChatPiece
from server.sse import sse_event
from server.tool_call_parser import ToolCallDelta
from server.wire_format import WireFormat

_PREFIX = {"reasoning": "rs", "message": "msg", "function_call": "fc"}
_TEXT_EVENT = {"reasoning": "response.reasoning_text", "message": "response.output_text"}
_TERMINAL = {"completed": "response.completed", "incomplete": "response.incomplete"}


def _status(reason: FinishReason | None) -> str:
    if reason in (FinishReason.LENGTH, FinishReason.TIMEOUT):
        return "incomplete"
    return {FinishReason.STOP: "completed", FinishReason.CANCELLED: "cancelled"}.get(reason, "failed")


def _item_status(status: str) -> str:
    """How the item a reply ended in is marked: items know no failed or cancelled state."""
    return "completed" if status == "completed" else "incomplete"


@dataclass
class _Item:
    kind: str                   # "reasoning", "message" or "function_call"
    index: int                  # its output_index
    text: str = ""              # the reasoning or message text, or the call's arguments
    name: str | None = None
    call_id: str | None = None
    namespace: str | None = None    # a call of a namespace tool's function

    def __post_init__(self) -> None:
        self.id = f"{_PREFIX[self.kind]}_{uuid.uuid4().hex}"

    def where(self) -> dict:
        """The fields an event about this item names it by."""
        return {"item_id": self.id, "output_index": self.index}

    def text_event(self, suffix: str, **fields) -> dict:
        """A .delta or .done event of the item's text (the answer's also carry logprobs, which
        this server does not give here)."""
        extra = {"logprobs": []} if self.kind == "message" else {}
        return {"type": f"{_TEXT_EVENT[self.kind]}.{suffix}", **self.where(), "content_index": 0, **fields,
                **extra}

    def part(self) -> dict:
        if self.kind == "message":
            return {"type": "output_text", "text": self.text, "annotations": []}
        return {"type": "reasoning_text", "text": self.text}

    def as_dict(self, status: str) -> dict:
        """The item as the API shows it; while in progress its content is still empty."""
        done = status != "in_progress"
        head = {"id": self.id, "type": self.kind, "status": status}
        if self.kind == "function_call":
            return head | {"call_id": self.call_id, "name": self.name, "arguments": self.text if done else ""} | (
                {"namespace": self.namespace} if self.namespace else {})
        if self.kind == "reasoning":
            return head | {"summary": [], "content": [self.part()] if done else []}
        return head | {"role": "assistant", "content": [self.part()] if done else []}


class OutputItems:
    """One reply's output items, built piece by piece; each step returns the stream events it
    makes (without sequence numbers). A whole answer is the same steps over a single piece."""

    def __init__(self, namespaced: dict[str, tuple[str, str]] | None = None):
        self.items: list[_Item] = []
        self._open: _Item | None = None
        self._calls: dict[int, _Item] = {}      # the parser's call index -> its item
        self._namespaced = namespaced or {}     # the model's name of a namespace's function -> both parts

    def add(self, piece: ChatPiece) -> list[dict]:
        # a piece's order: more arguments of calls begun earlier, then reasoning, answer text and
        # the calls it begins (text after a call's start tag came in a later piece than the tag)
        earlier = set(self._calls)
        events = [e for c in piece.tool_calls if c.index in earlier for e in self._arguments(c)]
        for kind, text in (("reasoning", piece.reasoning), ("message", piece.content)):
            if text:
                events += self._text(kind, text)
        for call in (c for c in piece.tool_calls if c.index not in earlier):
            if call.index not in self._calls:
                namespace, name = self._namespaced.get(call.name, (None, call.name))
                item = _Item("function_call", len(self.items), name=name, call_id=call.id, namespace=namespace)
                events += self._start(item)
                self._calls[call.index] = item
            events += self._arguments(call)
        return events

    def close(self, status: str = "completed") -> list[dict]:
        """Ends the open item (`status`: how the reply ended, for the item it cut off)."""
        item, self._open = self._open, None
        if item is None:
            return []
        if item.kind == "function_call":
            events = [{"type": "response.function_call_arguments.done", **item.where(), "name": item.name,
                       "arguments": item.text}]
        else:
            events = [item.text_event("done", text=item.text),
                      {"type": "response.content_part.done", **item.where(), "content_index": 0,
                       "part": item.part()}]
        return events + [{"type": "response.output_item.done", "output_index": item.index,
                          "item": item.as_dict(status)}]

    def output(self, status: str) -> list[dict]:
        """Every item as the finished response lists it; the last one carries how it ended."""
        return [item.as_dict(status if item is self.items[-1] else "completed") for item in self.items]

    def _start(self, item: _Item) -> list[dict]:
        events = self.close()
        self.items.append(item)
        self._open = item
        events.append({"type": "response.output_item.added", "output_index": item.index,
                       "item": item.as_dict("in_progress")})
        if item.kind != "function_call":
            events.append({"type": "response.content_part.added", **item.where(), "content_index": 0,
                           "part": item.part()})
        return events

    def _text(self, kind: str, text: str) -> list[dict]:
        same = self._open is not None and self._open.kind == kind
        events = [] if same else self._start(_Item(kind, len(self.items)))
        self._open.text += text
        return events + [self._open.text_event("delta", delta=text)]

    def _arguments(self, call: ToolCallDelta) -> list[dict]:
        item = self._calls.get(call.index)
        if item is None or not call.arguments:
            return []
        item.text += call.arguments
        return [{"type": "response.function_call_arguments.delta", **item.where(), "delta": call.arguments}]


class ResponsesFormat(WireFormat):
    def __init__(self, response_id: str, model: str, tokenizer, output: ChatOutput, echo: dict,
                 namespaced: dict[str, tuple[str, str]] | None = None, keep: Callable[[dict], None] | None = None):
        super().__init__(response_id, model, tokenizer)
        self.output = output
        self.echo = echo                # the request fields every response object repeats
        self._keep = keep
        self.items = OutputItems(namespaced)
        self._sequence = 0
        self._failed = False

    def _response(self, status: str, last: Delta | None = None, error: dict | None = None) -> dict:
        cut = {"reason": "max_output_tokens"} if status == "incomplete" else None
        body = {"id": self.id, "object": "response", "created_at": self.created, "status": status,
                "error": error, "incomplete_details": cut, "model": self.model, "output": [], "usage": None,
                **self.echo}
        if last is not None:
            body |= {"output": self.items.output(_item_status(status)), "usage": self._usage(last)}
        if status == "completed":
            body["completed_at"] = int(time.time())
        return body

    def _final(self, status: str, last: Delta | None = None, error: dict | None = None) -> dict:
        """The finished response object, kept where the request asked."""
        body = self._response(status, last, error)
        if self._keep is not None:
            self._keep(body)
        return body

    def _usage(self, last: Delta) -> dict:
        # the engine does not count reasoning tokens apart: re-encoding their text comes close
        reasoning = sum(len(self._tokenizer.encode(item.text)) for item in self.items.items
                        if item.kind == "reasoning")
        return {"input_tokens": last.prompt_tokens, "output_tokens": last.completion_tokens,
                "total_tokens": last.prompt_tokens + last.completion_tokens,
                "input_tokens_details": {"cached_tokens": last.cached_tokens, "cache_write_tokens": 0},
                "output_tokens_details": {"reasoning_tokens": min(reasoning, last.completion_tokens)}}

    def whole(self, totals: list[Delta]) -> dict:
        total = totals[0]
        status = _status(total.finish_reason)
        self.items.add(self.output.feed(total.text, final=True))
        self.items.close(_item_status(status))
        return self._final(status, total)

    # ---- streaming
    def _event(self, payload: dict) -> bytes:
        payload = payload | {"sequence_number": self._sequence}
        self._sequence += 1
        return sse_event(payload, event=payload["type"])

    def opening(self) -> list[bytes]:
        started = self._response("in_progress")
        return [self._event({"type": "response.created", "response": started}),
                self._event({"type": "response.in_progress", "response": started})]

    def events(self, index: int, delta: Delta) -> list[bytes]:
        piece = self.output.feed(delta.text, final=delta.finish_reason is not None)
        return [self._event(e) for e in self.items.add(piece)]

    def closing(self, last: list[Delta], include_usage: bool) -> list[bytes]:
        if self._failed:        # error_event has ended the stream
            return []
        status = _status(last[0].finish_reason)
        # only a cancelled request gets here unfinished: the engine's failures come as error_event
        error = None if status in _TERMINAL else {"code": "server_error",
                                                    "message": "the request was cancelled"}
        events = self.items.close(_item_status(status))
        events.append({"type": _TERMINAL.get(status, "response.failed"),
                       "response": self._final(status, last[0], error)})
        return [self._event(e) for e in events]

    def error_event(self, error) -> bytes:
        self._failed = True
        failed = self._final("failed", error={"code": "server_error", "message": error.message})
        return (self._event({"type": "error", "code": error.code, "message": error.message,
                             "param": error.param})
                + self._event({"type": "response.failed", "response": failed}))
