"""OpenAI response objects for chat and text completions: whole answers and stream chunks for every
choice, tool calls, reasoning, logprobs."""
from __future__ import annotations

from engine.output import Delta
from engine.request import FinishReason
from server.chat_output import ChatOutput, whole_calls
from server.sse import sse_event
from server.tool_call_parser import ToolCallDelta
from server.wire_format import WireFormat


def finish_reason(reason: FinishReason | None) -> str | None:
    """OpenAI's name: a request stopped by the server's time limit ended "length", as if out of tokens."""
    if reason is FinishReason.TIMEOUT:
        return FinishReason.LENGTH.value
    return None if reason is None else reason.value


def usage_of(totals: list[Delta]) -> dict:
    """The choices share one prompt: it counts once, and so do its tokens read from the prefix
    cache, as the first choice found them (the later ones start from the first's blocks)."""
    prompt, completion = max(t.prompt_tokens for t in totals), sum(t.completion_tokens for t in totals)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": min(t.cached_tokens for t in totals)}}


class _Format(WireFormat):
    """OpenAI's stream: one `data:` chunk per delta, the usage chunk if asked, then [DONE]."""

    def _token_text(self, token_id: int) -> str:
        return self._tokenizer.decode([token_id], skip_special_tokens=False)

    def _envelope(self, obj: str, choices: list, **extra) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "choices": choices, **extra}

    def opening(self) -> list[bytes]:
        return [sse_event(chunk) for chunk in self.role_chunks()]

    def events(self, index: int, delta: Delta) -> list[bytes]:
        chunk = self.chunk(index, delta)
        return [] if chunk is None else [sse_event(chunk)]

    def closing(self, last: list[Delta], include_usage: bool) -> list[bytes]:
        usage_chunk = self._envelope(self.CHUNK, [], usage=usage_of(last))
        return ([sse_event(usage_chunk)] if include_usage else []) + [sse_event("[DONE]")]

    def error_event(self, error) -> bytes:
        return sse_event(error.body())


class ChatFormat(_Format):
    CHUNK = "chat.completion.chunk"

    def __init__(self, request_id: str, model: str, tokenizer, outputs: list[ChatOutput],
                 want_logprobs: bool = False, reasoning_field: bool = False):
        super().__init__(request_id, model, tokenizer, want_logprobs)
        self.outputs = outputs          # one per choice
        self.reasoning_field = reasoning_field  # the server splits reasoning: the field is always there

    def logprobs(self, entries: list[tuple]) -> dict | None:
        if not entries:
            return None

        def item(token_id: int, logprob: float) -> dict:
            # the token's own bytes: a token that ends inside a character has no text of its own
            return {"token": self._token_text(token_id), "logprob": logprob,
                    "bytes": list(self._tokenizer.token_bytes(token_id))}
        return {"content": [item(t, lp) | {"top_logprobs": [item(i, v) for i, v in top]}
                            for t, lp, top in entries]}

    def role_chunks(self) -> list[dict]:
        return [self._envelope(self.CHUNK, [{"index": i, "delta": {"role": "assistant", "content": ""},
                                             "logprobs": None, "finish_reason": None}])
                for i in range(len(self.outputs))]

    def _reason(self, index: int, reason: FinishReason | None) -> str | None:
        if reason is FinishReason.STOP and self.outputs[index].called:
            return "tool_calls"
        return finish_reason(reason)

    def chunk(self, index: int, delta: Delta) -> dict | None:
        piece = self.outputs[index].feed(delta.text, final=delta.finish_reason is not None)
        logprobs = self.logprobs(delta.logprobs) if self.want_logprobs else None
        if not piece and delta.finish_reason is None and logprobs is None:
            return None
        body: dict = {}
        if piece.reasoning:
            body["reasoning_content"] = piece.reasoning
        if piece.content:
            body["content"] = piece.content
        if piece.tool_calls:
            body["tool_calls"] = [_call_delta(c) for c in piece.tool_calls]
        return self._envelope(self.CHUNK, [{"index": index, "delta": body, "logprobs": logprobs,
                                            "finish_reason": self._reason(index, delta.finish_reason)}])

    def whole(self, totals: list[Delta]) -> dict:
        choices = []
        for i, total in enumerate(totals):
            output = self.outputs[i]
            piece = output.feed(total.text, final=True)
            message: dict = {"role": "assistant",
                             "content": piece.content or (None if piece.tool_calls else "")}
            if self.reasoning_field:
                message["reasoning_content"] = piece.reasoning or None
            if piece.tool_calls:
                message["tool_calls"] = whole_calls(piece.tool_calls)
            choices.append({"index": i, "message": message,
                            "logprobs": self.logprobs(total.logprobs) if self.want_logprobs else None,
                            "finish_reason": self._reason(i, total.finish_reason)})
        return self._envelope("chat.completion", choices, usage=usage_of(totals))


def _call_delta(call: ToolCallDelta) -> dict:
    out: dict = {"index": call.index}
    if call.id is not None:
        out |= {"id": call.id, "type": "function"}
    function = {"arguments": call.arguments}
    if call.name is not None:
        function = {"name": call.name} | function
    return out | {"function": function}


class TextFormat(_Format):
    CHUNK = "text_completion"

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self._offsets: dict[int, int] = {}      # each choice's text_offset so far in a stream

    def logprobs(self, entries: list[tuple], offset: int = 0) -> dict | None:
        """`text_offset` counts from `offset`: a stream's chunks go on where the last one ended."""
        if not entries:
            return None
        tokens = [self._token_text(t) for t, _, _ in entries]
        offsets, at = [], offset
        for text in tokens:
            offsets.append(at)
            at += len(text)
        return {"tokens": tokens, "token_logprobs": [lp for _, lp, _ in entries],
                "top_logprobs": [{self._token_text(i): v for i, v in top} for _, _, top in entries],
                "text_offset": offsets}

    def _streamed_logprobs(self, index: int, entries: list[tuple]) -> dict | None:
        logprobs = self.logprobs(entries, self._offsets.get(index, 0))
        if logprobs is not None:
            self._offsets[index] = logprobs["text_offset"][-1] + len(logprobs["tokens"][-1])
        return logprobs

    def role_chunks(self) -> list[dict]:
        return []

    def chunk(self, index: int, delta: Delta) -> dict | None:
        logprobs = self._streamed_logprobs(index, delta.logprobs) if self.want_logprobs else None
        if not delta.text and delta.finish_reason is None and logprobs is None:
            return None
        return self._envelope(self.CHUNK, [{"index": index, "text": delta.text, "logprobs": logprobs,
                                            "finish_reason": finish_reason(delta.finish_reason)}])

    def whole(self, totals: list[Delta]) -> dict:
        return self._envelope("text_completion", [
            {"index": i, "text": total.text,
             "logprobs": self.logprobs(total.logprobs) if self.want_logprobs else None,
             "finish_reason": finish_reason(total.finish_reason)} for i, total in enumerate(totals)],
            usage=usage_of(totals))
