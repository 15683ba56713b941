"""OpenAI response objects for chat and text completions: whole answers, stream chunks, logprobs."""
from __future__ import annotations

import time

from engine.request import FinishReason


def finish_reason(reason: FinishReason | None) -> str | None:
    return None if reason is None else reason.value


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


class _Format:
    def __init__(self, request_id: str, model: str, tokenizer):
        self.id = request_id
        self.model = model
        self.created = int(time.time())
        self._tokenizer = tokenizer

    def _token_text(self, token_id: int) -> str:
        return self._tokenizer.decode([token_id], skip_special_tokens=False)

    def _envelope(self, obj: str, choices: list, **extra) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "choices": choices, **extra}

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> dict:
        return self._envelope(self.CHUNK, [], usage=usage(prompt_tokens, completion_tokens))


class ChatFormat(_Format):
    CHUNK = "chat.completion.chunk"

    def logprobs(self, entries: list[tuple]) -> dict | None:
        if not entries:
            return None

        def item(token_id: int, logprob: float) -> dict:
            text = self._token_text(token_id)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}
        return {"content": [item(t, lp) | {"top_logprobs": [item(i, v) for i, v in top]}
                            for t, lp, top in entries]}

    def role_chunk(self) -> dict:
        return self._envelope(self.CHUNK, [{"index": 0, "delta": {"role": "assistant",
                                                                   "content": ""},
                                            "logprobs": None, "finish_reason": None}])

    def chunk(self, text: str, logprobs: list[tuple], reason: FinishReason | None,
              want_logprobs: bool) -> dict:
        delta = {"content": text} if text or reason is None else {}
        return self._envelope(self.CHUNK, [{
            "index": 0, "delta": delta,
            "logprobs": self.logprobs(logprobs) if want_logprobs else None,
            "finish_reason": finish_reason(reason)}])

    def whole(self, text: str, logprobs: list[tuple], reason: FinishReason | None,
              want_logprobs: bool, prompt_tokens: int, completion_tokens: int) -> dict:
        return self._envelope("chat.completion", [{
            "index": 0, "message": {"role": "assistant", "content": text},
            "logprobs": self.logprobs(logprobs) if want_logprobs else None,
            "finish_reason": finish_reason(reason)}],
            usage=usage(prompt_tokens, completion_tokens))


class TextFormat(_Format):
    CHUNK = "text_completion"

    def logprobs(self, entries: list[tuple], offset: int = 0) -> dict | None:
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

    def role_chunk(self) -> None:
        return None

    def chunk(self, text: str, logprobs: list[tuple], reason: FinishReason | None,
              want_logprobs: bool) -> dict:
        return self._envelope(self.CHUNK, [{
            "index": 0, "text": text,
            "logprobs": self.logprobs(logprobs) if want_logprobs else None,
            "finish_reason": finish_reason(reason)}])

    def whole(self, text: str, logprobs: list[tuple], reason: FinishReason | None,
              want_logprobs: bool, prompt_tokens: int, completion_tokens: int) -> dict:
        return self._envelope("text_completion", [{
            "index": 0, "text": text,
            "logprobs": self.logprobs(logprobs) if want_logprobs else None,
            "finish_reason": finish_reason(reason)}],
            usage=usage(prompt_tokens, completion_tokens))
