"""Request bodies of Ollama's API (/api/chat, /api/generate; pydantic) and their translation to what
the chat core and SamplingBody read: sampling from `options` under Ollama's names, `format` as an
output grammar, `think` as the template's switch, messages and tool calls as chat templates take them."""
from __future__ import annotations

import logging
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from server.schemas import Finite, SamplingBody, Tool, unsupported

log = logging.getLogger("pagedserve.server")
# options that set up Ollama's runner (context size, threads, GPU layers, memory mapping...): this
# server's own configuration decides those, so they are ignored, and logged once per name
_RUNNER_OPTIONS = {"num_ctx", "num_batch", "num_gpu", "main_gpu", "low_vram", "num_thread", "numa", "use_mmap",
                   "use_mlock", "vocab_only", "f16_kv", "logits_all", "embedding_only", "num_keep",
                   "repeat_last_n", "penalize_newline"}
_ignored_logged: set[str] = set()


class Options(BaseModel):
    """Ollama's `options`, the sampling ones this server implements; runner options are ignored."""
    model_config = ConfigDict(extra="allow")
    num_predict: int | None = Field(None, ge=-2)
    temperature: Finite | None = None
    top_p: Finite | None = None
    top_k: int | None = None
    min_p: Finite | None = None
    seed: int | None = None
    repeat_penalty: Finite | None = None
    presence_penalty: Finite | None = None
    frequency_penalty: Finite | None = None
    stop: str | list[str] | None = None
    mirostat: int | None = None
    typical_p: Finite | None = None
    tfs_z: Finite | None = None

    def check(self) -> None:
        """Samplers Ollama has and this server does not are refused; runner options are ignored."""
        if self.mirostat:
            raise unsupported("options.mirostat", "this server samples with temperature, top_k, top_p and "
                                                  "min_p; send mirostat 0")
        for name, off in (("typical_p", 1.0), ("tfs_z", 1.0)):
            if getattr(self, name) not in (None, off):
                raise unsupported(f"options.{name}", f"not implemented here; leave it out or send {off}")
        for name in self.model_extra or {}:
            if name not in _ignored_logged:
                _ignored_logged.add(name)
                log.warning("ignoring options.%s: %s", name, "this server's configuration sets it"
                            if name in _RUNNER_OPTIONS else "this server does not know it")


class OllamaBody(SamplingBody):
    """What /api/chat and /api/generate share. Ollama streams unless told `stream: false`."""
    model: str = Field(min_length=1)
    stream: bool = True
    options: Options | None = None
    format: Literal["", "json"] | dict | None = None
    think: bool | Literal["low", "medium", "high"] | None = None
    keep_alive: Any = None          # the model stays loaded while the server runs
    logprobs: bool | None = None
    top_logprobs: int | None = None

    @model_validator(mode="after")
    def _from_options(self) -> OllamaBody:
        o = self.options or Options()
        # num_predict -1 (no limit) and -2 (fill the context) both run to the end of the context
        self.max_tokens = None if o.num_predict is None or o.num_predict < 0 else max(1, o.num_predict)
        for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                     "stop"):
            setattr(self, name, getattr(o, name))
        self.seed = o.seed if o.seed is None or o.seed >= 0 else None     # Ollama: -1 = random
        self.repetition_penalty = o.repeat_penalty
        self.model = self.model.removesuffix(":latest")     # Ollama's default tag
        return self

    PARAM_NAMES: ClassVar[dict[str, str]] = {
        "max_tokens": "options.num_predict", "temperature": "options.temperature", "top_p": "options.top_p",
        "top_k": "options.top_k", "min_p": "options.min_p", "seed": "options.seed",
        "repetition_penalty": "options.repeat_penalty", "presence_penalty": "options.presence_penalty",
        "frequency_penalty": "options.frequency_penalty"}

    def check_fields(self) -> None:
        super().check_fields()
        if self.logprobs or self.top_logprobs:
            raise unsupported("logprobs", "Ollama's logprobs are not implemented; /v1/chat/completions returns them")
        if self.options is not None:
            self.options.check()

    def _constraints(self) -> list[tuple[str, Any, str]]:
        fmt = {"type": "object"} if self.format == "json" else self.format or None
        return super()._constraints() + [("format", fmt, "json_schema")]

    def template_kwargs(self) -> dict:
        return {} if self.think is None else {"enable_thinking": self.think is not False}


class OllamaFunctionCall(BaseModel):
    name: str
    arguments: dict[str, Any] = Field(default_factory=dict)


class OllamaToolCall(BaseModel):
    function: OllamaFunctionCall


class OllamaMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    thinking: str | None = None
    images: list[Any] | None = None
    tool_calls: list[OllamaToolCall] | None = None
    tool_name: str | None = None

    def for_template(self, where: str) -> dict:
        if self.images:
            raise unsupported(f"{where}.images", "this server reads text only")
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            out["tool_calls"] = [{"type": "function", "function": c.function.model_dump()} for c in self.tool_calls]
        if self.thinking:
            out["reasoning_content"] = self.thinking
        if self.tool_name:
            out["name"] = self.tool_name
        return out


class OllamaChatRequest(OllamaBody):
    """POST /api/chat."""
    messages: list[OllamaMessage] = Field(min_length=1)
    tools: list[Tool] | None = None

    def chat(self) -> list[dict]:
        return [m.for_template(f"messages.{i}") for i, m in enumerate(self.messages)]


class OllamaGenerateRequest(OllamaBody):
    """POST /api/generate: `prompt` through the chat template as a user turn (after `system`), as it
    is with `raw`, or with `suffix` the model's fill-in-the-middle prompt."""
    prompt: str = ""
    suffix: str | None = None
    system: str | None = None
    raw: bool = False
    images: list[Any] | None = None
    template: str | None = None
    context: list[int] | None = None

    UNSUPPORTED: ClassVar[dict[str, str]] = {
        "images": "this server reads text only",
        "template": "the model's own chat template is used; send raw=true with the prompt already laid out",
        "context": "the deprecated context ids are not read; send the conversation to /api/chat (the "
                   "prefix cache reuses what it has already computed)",
    }

    def is_load(self) -> bool:
        """Ollama's load request: nothing to generate, the answer says the model is loaded."""
        return not self.prompt and self.suffix is None

    def chat(self) -> list[dict]:
        return ([{"role": "system", "content": self.system}] if self.system else []) + [
            {"role": "user", "content": self.prompt}]


class ShowRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    name: str | None = None         # older clients' spelling
    verbose: bool = False
