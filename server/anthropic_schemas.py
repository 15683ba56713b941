"""Request bodies of Anthropic's Messages API (pydantic) and their translation to what the chat core
reads: OpenAI-shaped messages for the chat template, tools, tool_choice and sampling fields."""
from __future__ import annotations

import json
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from engine.grammar import Grammar
from server.errors import APIError
from server.schemas import Finite, NamedFunction, NamedToolChoice, SamplingBody, unsupported


# Claude Code starts its system prompt with this line, whose hash changes with every request: it tells
# the model nothing, and left in, no request would find the one before it in the prefix cache
_BILLING = "x-anthropic-billing-header:"


def _without_billing(text: str) -> str:
    return text.partition("\n")[2] if text.startswith(_BILLING) else text


class Block(BaseModel):
    """One content block; which fields matter depends on `type`."""
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None
    id: str | None = None               # tool_use
    name: str | None = None
    input: Any = None
    tool_use_id: str | None = None      # tool_result
    content: str | list[Block] | None = None
    is_error: bool = False
    thinking: str | None = None         # thinking


def _text(content: str | list[Block] | None, where: str, allowed: tuple[str, ...] = ("text",)) -> str:
    if not isinstance(content, list):
        return content or ""
    for j, block in enumerate(content):
        if block.type not in allowed:
            raise unsupported(f"{where}.{j}.type", f"content blocks of type {block.type!r} here; this "
                                                   f"server reads {', '.join(allowed)} blocks")
    return "".join(b.text or "" for b in content if b.type == "text")


class Message(BaseModel):
    # "system": an instruction in the middle of the conversation (Claude Code sends them)
    role: Literal["user", "assistant", "system"]
    content: str | list[Block]

    def for_template(self, where: str) -> list[dict]:
        """This turn as chat-template messages: a user turn's tool results become `tool`
        messages (before its text), an assistant turn's tool_use blocks its tool_calls."""
        blocks = self.content if isinstance(self.content, list) else [Block(type="text", text=self.content)]
        if self.role == "system":
            return [{"role": "system", "content": _text(blocks, f"{where}.content")}]
        if self.role == "user":
            out = [{"role": "tool", "tool_call_id": b.tool_use_id,
                    "content": ("[error] " if b.is_error else "") + _text(b.content, f"{where}.content.{j}.content")}
                   for j, b in enumerate(blocks) if b.type == "tool_result"]
            text = _text([b for b in blocks if b.type != "tool_result"], f"{where}.content")
            return out + ([{"role": "user", "content": text}] if text or not out else [])
        message: dict = {"role": "assistant",
                         "content": _text([b for b in blocks if b.type in ("text", "tool_use", "thinking",
                                                                            "redacted_thinking")],
                                          f"{where}.content", ("text", "tool_use", "thinking",
                                                               "redacted_thinking"))}
        calls = [{"id": b.id, "type": "function", "function": {"name": b.name, "arguments": b.input or {}}}
                 for b in blocks if b.type == "tool_use"]
        if calls:
            message["tool_calls"] = calls
        thinking = "".join(b.thinking or "" for b in blocks if b.type == "thinking")
        if thinking:
            message["reasoning_content"] = thinking
        return [message]


class AnthropicTool(BaseModel):
    name: str = Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")
    description: str | None = None
    input_schema: dict = Field(default_factory=lambda: {"type": "object"})
    type: str | None = None

    def as_openai(self) -> dict:
        if self.type not in (None, "custom"):
            raise unsupported("tools", f"server tools of type {self.type!r}; this server runs only the "
                                       "client's own tools (name, description, input_schema)")
        function = {"name": self.name, "parameters": self.input_schema}
        return {"type": "function", "function": function | ({"description": self.description}
                                                            if self.description else {})}


class ToolChoice(BaseModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False

    def as_openai(self):
        """OpenAI's tool_choice for the chat core."""
        if self.type == "tool":
            if not self.name:
                raise APIError(400, "tool_choice of type tool needs the tool's name", param="tool_choice",
                               code="invalid_value")
            return NamedToolChoice(type="function", function=NamedFunction(name=self.name))
        return {"auto": "auto", "any": "required", "none": "none"}[self.type]


class Thinking(BaseModel):
    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    budget_tokens: int | None = None


class OutputFormat(BaseModel):
    type: Literal["json_schema"]
    schema_: dict = Field(alias="schema")


class OutputConfig(BaseModel):
    format: OutputFormat | None = None
    effort: str | None = None       # how hard to think: this server has no such dial


class MessagesRequest(SamplingBody):
    """POST /v1/messages. Sampling goes through SamplingBody (one translation for every API);
    `max_tokens` is required here, as Anthropic requires it."""
    max_tokens: int = Field(ge=1)
    messages: list[Message] = Field(min_length=1)
    system: str | list[Block] | None = None
    stop_sequences: list[str] | None = None
    temperature: Finite | None = Field(None, ge=0, le=1)
    tools: list[AnthropicTool] | None = None
    tool_choice: ToolChoice | None = None
    metadata: dict | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None

    # OpenAI's names are not Anthropic's: a client sending them gets told, not ignored
    UNSUPPORTED: ClassVar[dict[str, str]] = {
        "n": "Anthropic's API returns one message; send the request again for another",
        "logit_bias": "not part of Anthropic's API; use /v1/chat/completions",
        "response_format": "not part of Anthropic's API; send output_config.format",
    }

    def output_grammar(self) -> tuple[Grammar, str] | None:
        fmt = self.output_config.format if self.output_config else None
        if fmt is None:
            return super().output_grammar()
        return Grammar.json_schema(fmt.schema_), "output_config.format.schema"

    @model_validator(mode="after")
    def _names(self) -> "MessagesRequest":
        self.stop = self.stop_sequences
        self.user = (self.metadata or {}).get("user_id") or self.user
        return self

    def check_fields(self) -> None:
        super().check_fields()
        if self.messages[0].role != "user":
            raise APIError(400, "messages: the first message must have role \"user\"", param="messages.0.role",
                           code="invalid_value")

    def chat(self, tools_first: bool = False) -> list[dict]:
        """The conversation for the chat template, less a trailing assistant turn (`prefill()`);
        `tools_first`: the template shows tools before a second system message (tools.renders_tools_first)."""
        system = None
        if self.system is not None:
            _text(self.system, "system")        # refuses blocks that are not text
            texts = [self.system] if isinstance(self.system, str) else [b.text or "" for b in self.system]
            system = "".join(_without_billing(t) for t in texts)
        messages = self.messages[:-1] if self.prefill() else self.messages
        turns = [m for i, msg in enumerate(messages) for m in msg.for_template(f"messages.{i}")]
        if not system:
            return turns
        if self.tools and tools_first:
            # Anthropic's cache prefix is tools, then system, then messages, and clients build on that:
            # Claude Code's system text names the project directory, its ~17k tokens of tools do not. The
            # template puts tools after the first system message, so that one stays empty and the text
            # follows the tools as a system turn of its own: a new session reuses the cached tools.
            return [{"role": "system", "content": ""}, {"role": "system", "content": system}] + turns
        return [{"role": "system", "content": system}] + turns

    def openai_tools(self) -> list[dict]:
        return [t.as_openai() for t in self.tools or ()]

    def template_kwargs(self) -> dict:
        if self.thinking is None:
            return {}
        return {"enable_thinking": self.thinking.type != "disabled"}

    def prefill(self) -> str:
        """The text of a trailing assistant turn: the reply continues it (Anthropic's prefill)."""
        last = self.messages[-1]
        if last.role != "assistant" or len(self.messages) < 2:
            return ""
        return _text(last.content, f"messages.{len(self.messages) - 1}.content")


class CountTokensRequest(MessagesRequest):
    max_tokens: int = 1         # not asked for by count_tokens


def dumps_input(arguments: str) -> dict:
    """A tool call's JSON arguments as Anthropic's `input` object (text that is not an object
    is kept under "arguments", so nothing the model wrote is lost)."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return {"arguments": arguments}
    return value if isinstance(value, dict) else {"arguments": value}
