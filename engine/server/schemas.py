"""Request bodies of the OpenAI-compatible routes (pydantic) and their translation to SamplingParams.

Types are checked here; value ranges live in SamplingParams (one source) and come back as 400s
naming the param. Unknown fields are ignored, as OpenAI clients send extras.
"""
from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, Field

from engine.request import SamplingError, SamplingParams
from engine.server.errors import APIError

Finite = Annotated[float, Field(allow_inf_nan=False)]
Seed = Annotated[int, Field(ge=0, le=2**63 - 1)]


class TextPart(BaseModel):
    type: Literal["text"] = "text"
    text: str


class ChatMessage(BaseModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Sampling(BaseModel):
    """Fields shared by chat and text completions."""
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: Finite | None = None
    top_p: Finite | None = None
    top_k: int | None = None
    min_p: Finite | None = None
    min_tokens: int | None = Field(None, ge=0)
    stop: str | list[str] | None = None
    seed: Seed | None = None
    presence_penalty: Finite | None = None
    frequency_penalty: Finite | None = None
    repetition_penalty: Finite | None = None
    n: int | None = None
    ignore_eos: bool = False
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None

    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def _limit(self) -> int | None:
        return self.max_tokens

    def _top_logprobs(self) -> int | None:
        return None

    def sampling_params(self) -> SamplingParams:
        if self.n not in (None, 1):
            raise APIError(400, f"n={self.n} is not supported: this server returns one choice per "
                                "request; send n=1 (or leave it out) and repeat the request instead",
                           param="n", code="unsupported_value")
        given = {k: getattr(self, k) for k in ("temperature", "top_p", "top_k", "min_p", "min_tokens",
                                               "seed", "presence_penalty", "frequency_penalty",
                                               "repetition_penalty")
                 if getattr(self, k) is not None}
        if self._limit() is not None:
            given["max_tokens"] = self._limit()
        stop = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        try:
            return SamplingParams(**given, stop=tuple(stop), ignore_eos=self.ignore_eos,
                                  logprobs=self._top_logprobs())
        except SamplingError as e:
            param = str(e).split("=", 1)[0].split(" ", 1)[0]
            raise APIError(400, str(e), param=param if param in type(self).model_fields else "stop",
                           code="invalid_value") from None


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = None

    def _limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def _top_logprobs(self) -> int | None:
        if not self.logprobs:
            if self.top_logprobs:
                raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs",
                               code="invalid_value")
            return None
        return self.top_logprobs or 0

    def chat(self) -> list[dict]:
        return [{"role": m.role, "content": m.text()} for m in self.messages]


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str]
    logprobs: int | None = None
    echo: bool = False

    def _top_logprobs(self) -> int | None:
        return self.logprobs

    def single_prompt(self) -> str | list[int]:
        if self.echo:
            raise APIError(400, "echo=true is not supported", param="echo", code="unsupported_value")
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], str):
            if len(self.prompt) != 1:
                raise APIError(400, f"prompt holds {len(self.prompt)} prompts; this server takes one "
                                    "prompt per request (a string or a list of token ids)",
                               param="prompt", code="unsupported_value")
            return self.prompt[0]
        return self.prompt


class TokenizeRequest(BaseModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = False


class DetokenizeRequest(BaseModel):
    model: str | None = None
    tokens: list[int]
