"""Request bodies of the OpenAI-compatible routes (pydantic) and their translation to SamplingParams.

Types are checked here; value ranges live in SamplingParams (one source) and come back as 400s
naming the param. Fields OpenAI defines that this server does not implement are refused with a 400
naming them; fields nobody here knows are ignored (clients send extras) and logged once per name.
"""
from __future__ import annotations

import json
import logging
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from engine.grammar import Grammar, GrammarError
from engine.request import SamplingError, SamplingParams
from server.errors import APIError

log = logging.getLogger("pagedserve.server")

Finite = Annotated[float, Field(allow_inf_nan=False)]
Seed = Annotated[int, Field(ge=0, le=2**63 - 1)]
MAX_CHOICES = 128           # OpenAI's bound on n
SAMPLING_DEFAULT_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
_unknown_logged: set[str] = set()


def unsupported(param: str, why: str) -> APIError:
    return APIError(400, f"{param} is not supported: {why}", param=param, code="unsupported_value")


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str = "{}"       # JSON text, as OpenAI sends it back


class ToolCall(BaseModel):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None

    def text(self, where: str = "messages") -> str:
        if not isinstance(self.content, list):
            return self.content or ""
        for j, part in enumerate(self.content):
            if part.type != "text" or part.text is None:
                raise unsupported(f"{where}.content.{j}.type",
                                  f"content parts of type {part.type!r}; this server reads text parts "
                                  "({\"type\": \"text\", \"text\": ...})")
        return "".join(p.text for p in self.content)

    def for_template(self, where: str) -> dict:
        """The message as chat templates read it: text content, tool-call arguments as objects."""
        out: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role,
                               "content": self.text(where)}
        if self.tool_calls:
            out["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.function.name,
                                               "arguments": _json_or_text(c.function.arguments)}}
                                 for c in self.tool_calls]
        for key in ("name", "tool_call_id", "reasoning_content"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return out


def _grammar(kind: str, value) -> Grammar:
    if kind == "json_schema":
        return Grammar.json_schema(value)
    if kind == "choice":
        return Grammar.choice(value)
    return Grammar(kind, value)


def _json_or_text(text: str):
    # templates write arguments with `tojson`: an object, or the text when it is not JSON
    try:
        return json.loads(text)
    except ValueError:
        return text


class FunctionDef(BaseModel):
    name: str = Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class Tool(BaseModel):
    type: Literal["function"]
    function: FunctionDef

    def as_dict(self) -> dict:
        return {"type": "function", "function": self.function.model_dump(exclude_none=True)}


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(populate_by_name=True)
    name: str | None = None
    description: str | None = None
    schema_: dict | bool = Field(default=True, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs`: exactly one of these."""
    model_config = ConfigDict(populate_by_name=True)
    json_: dict | bool | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingBody(BaseModel):
    """Fields shared by chat and text completions."""
    model_config = ConfigDict(extra="allow")
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
    logit_bias: dict[str, Finite] | None = None
    n: int | None = Field(None, ge=1, le=MAX_CHOICES)
    ignore_eos: bool = False
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict | bool | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    # OpenAI fields this server knows and does not implement: a 400 naming them, never a silent drop
    UNSUPPORTED: ClassVar[dict[str, str]] = {}
    # SamplingParams' names as this request spells them
    PARAM_NAMES: ClassVar[dict[str, str]] = {}

    def check_fields(self) -> None:
        for name, why in self.UNSUPPORTED.items():
            if name in self.model_fields_set and getattr(self, name, None) is not None:
                raise unsupported(name, why)
        for name in self.model_extra or {}:
            if name not in _unknown_logged:
                _unknown_logged.add(name)
                log.warning("ignoring request field %r: this server does not know it", name)

    @property
    def choices(self) -> int:
        return self.n or 1

    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def _limit(self) -> int | None:
        return self.max_tokens

    def _top_logprobs(self) -> int | None:
        return None

    def logit_bias_ids(self) -> list[int]:
        """The token ids logit_bias names (400 if a key is not an integer)."""
        try:
            return [int(k) for k in self.logit_bias or {}]
        except ValueError:
            raise APIError(400, "logit_bias keys must be token ids (integers as strings, e.g. "
                                "{\"1234\": -100})", param="logit_bias", code="invalid_value") from None

    def output_grammar(self) -> tuple[Grammar, str] | None:
        """The grammar the output must match, and the param it came from; at most one may be given."""
        given = []
        for param, value, kind in self._constraints():
            if value is None or value is False:
                continue
            try:
                given.append((_grammar(kind, value), param))
            except GrammarError as e:
                raise APIError(400, f"{param}: {e}", param=param, code="invalid_value") from None
        if len(given) > 1:
            names = ", ".join(name for _, name in given)
            raise APIError(400, f"give one output constraint, not several: {names}", param=given[1][1],
                           code="invalid_value")
        return given[0] if given else None

    def _constraints(self) -> list[tuple[str, Any, str]]:
        """(param, value, grammar kind) of every way a request can constrain its output."""
        fmt, so = self.response_format, self.structured_outputs
        out = []
        if fmt is not None and fmt.type == "json_object":
            out.append(("response_format", {"type": "object"}, "json_schema"))
        elif fmt is not None and fmt.type == "json_schema":
            if fmt.json_schema is None:
                raise APIError(400, "response_format of type json_schema needs a json_schema object "
                                    "({\"name\": ..., \"schema\": {...}})", param="response_format.json_schema",
                               code="invalid_value")
            out.append(("response_format.json_schema.schema", fmt.json_schema.schema_, "json_schema"))
        if so is not None:
            out += [("structured_outputs.json", so.json_, "json_schema"),
                    ("structured_outputs.regex", so.regex, "regex"),
                    ("structured_outputs.choice", so.choice, "choice"),
                    ("structured_outputs.grammar", so.grammar, "lark"),
                    ("structured_outputs.json_object", {"type": "object"} if so.json_object else None,
                     "json_schema")]
        return out + [("guided_json", self.guided_json, "json_schema"),
                      ("guided_regex", self.guided_regex, "regex"),
                      ("guided_choice", self.guided_choice, "choice"),
                      ("guided_grammar", self.guided_grammar, "lark")]

    def sampling_params(self, *, defaults: dict, max_tokens: int, grammar: Grammar | None = None
                        ) -> SamplingParams:
        """`defaults`: the model's own sampling defaults (generation_config.json) for fields left
        out; `max_tokens`: the limit when the request sets none (the rest of the context)."""
        given = {k: defaults[k] for k in SAMPLING_DEFAULT_FIELDS if k in defaults}
        given |= {k: getattr(self, k) for k in ("temperature", "top_p", "top_k", "min_p", "min_tokens",
                                                "seed", "presence_penalty", "frequency_penalty",
                                                "repetition_penalty")
                  if getattr(self, k) is not None}
        given["max_tokens"] = self._limit() or max_tokens
        stop = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        bias = dict(zip(self.logit_bias_ids(), (self.logit_bias or {}).values()))
        try:
            return SamplingParams(**given, stop=tuple(stop), ignore_eos=self.ignore_eos,
                                  logprobs=self._top_logprobs(), logit_bias=bias, grammar=grammar)
        except SamplingError as e:
            param = self.PARAM_NAMES.get(e.param, e.param)
            raise APIError(400, str(e).replace(e.param, param, 1), param=param, code="invalid_value") from None


class ChatCompletionRequest(SamplingBody):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    web_search_options: Any = None
    functions: Any = None
    function_call: Any = None

    PARAM_NAMES: ClassVar[dict[str, str]] = {"logprobs": "top_logprobs"}
    UNSUPPORTED: ClassVar[dict[str, str]] = {"audio": "this server answers in text only",
                   "prediction": "predicted outputs are not implemented",
                   "web_search_options": "this server has no web search",
                   "functions": "the deprecated `functions` field is not read; send `tools`",
                   "function_call": "the deprecated `function_call` field is not read; send `tool_choice`"}

    def check_fields(self) -> None:
        super().check_fields()
        if self.modalities is not None and list(self.modalities) != ["text"]:
            raise unsupported("modalities", "this server answers in text only (modalities [\"text\"])")

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
        return [m.for_template(f"messages.{i}") for i, m in enumerate(self.messages)]


class CompletionRequest(SamplingBody):
    prompt: str | list[int] | list[str]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None       # fill in the middle (server/fim.py)
    best_of: int | None = None

    def check_fields(self) -> None:
        super().check_fields()
        if self.echo:
            raise unsupported("echo", "the reply never repeats the prompt; set echo=false")
        if self.best_of is not None and self.best_of != self.choices:
            raise unsupported("best_of", "send n for several choices (best_of must equal n)")

    def _top_logprobs(self) -> int | None:
        return self.logprobs

    def single_prompt(self) -> str | list[int]:
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
