"""The request body of OpenAI's Responses API (pydantic) and its translation to what the chat core
reads: chat-template messages from `instructions`, the conversation a `previous_response_id` ends
and `input`; OpenAI chat tools and tool_choice; the output grammar from `text.format`; the request
fields a response echoes, and its input items as GET /v1/responses/{id}/input_items lists them."""
from __future__ import annotations

import logging
import uuid
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, TypeAdapter

from engine.request import SamplingParams
from server.errors import APIError
from server.schemas import (ChatMessage, FunctionCall, NamedFunction, NamedToolChoice, SamplingBody,
                                   ToolCall, unsupported)

_NO_CONVERSATIONS = ("this server keeps no conversation objects; continue a response with "
                     "previous_response_id, or send the whole conversation in `input`")
_TOOL_NAME = r"^[A-Za-z0-9_.\-]{1,64}$"
log = logging.getLogger("pagedserve.server")
_skipped_logged: set[str] = set()


class Part(BaseModel):
    """One content part of a message item; which fields matter depends on `type`."""
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None
    refusal: str | None = None


def _text(content: str | list[Part], where: str) -> str:
    """A message's (or a call output's) text: a string, or its text parts joined."""
    if isinstance(content, str):
        return content
    pieces = []
    for j, part in enumerate(content):
        if part.type in ("input_text", "output_text") and part.text is not None:
            pieces.append(part.text)
        elif part.type == "refusal" and part.refusal is not None:
            pieces.append(part.refusal)
        else:
            raise unsupported(f"{where}.{j}.type",
                              f"content parts of type {part.type!r}; this server reads text parts "
                              "({\"type\": \"input_text\", \"text\": ...})")
    return "".join(pieces)


class MessageItem(BaseModel):
    model_config = ConfigDict(extra="allow")    # id, status, phase: nothing to do with them
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[Part]


class FunctionCallItem(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str = "{}"
    namespace: str | None = None        # the namespace tool the function is in


class FunctionCallOutputItem(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[Part]


class OtherItem(BaseModel):
    """Reasoning items (dropped: the template writes its own) and types this server refuses."""
    model_config = ConfigDict(extra="allow")
    type: str


_KNOWN_ITEMS = ("message", "function_call", "function_call_output")


def _item_kind(item: Any) -> str:
    # the SDK's "easy" messages are role-only dicts: no `type` means a message
    kind = item.get("type", "message") if isinstance(item, dict) else getattr(item, "type", "message")
    return kind if kind in _KNOWN_ITEMS else "other"


InputItem = Annotated[Annotated[MessageItem, Tag("message")]
                      | Annotated[FunctionCallItem, Tag("function_call")]
                      | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
                      | Annotated[OtherItem, Tag("other")], Discriminator(_item_kind)]
_ITEMS = TypeAdapter(list[InputItem])
_ID_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco"}


def as_items(output: list[dict]) -> list:
    """A response's output items as input items, to continue its conversation from."""
    return _ITEMS.validate_python(output)


class FunctionTool(BaseModel):
    """A tool in Responses' flat shape: a function, a namespace of functions (`tools`), or a tool the
    API's host runs (web_search, file_search, ...), which this server has none of."""
    model_config = ConfigDict(extra="allow")
    type: str
    name: str | None = Field(None, pattern=_TOOL_NAME)
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None
    tools: list[FunctionTool] | None = None

    def as_chat(self, where: str, name: str | None = None) -> dict:
        """This function as an OpenAI chat tool dict, under `name` if given."""
        if self.name is None:
            raise APIError(400, f"{where} has no name; a function tool needs one", param=f"{where}.name",
                           code="invalid_value")
        function = {"name": name or self.name, "description": self.description, "parameters": self.parameters,
                    "strict": self.strict}
        return {"type": "function", "function": {k: v for k, v in function.items() if v is not None}}


class ToolChoiceObject(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    name: str | None = None


class TextFormat(BaseModel):
    model_config = ConfigDict(populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict | bool | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="allow")     # verbosity: the model has only one
    format: TextFormat | None = None


class ResponsesRequest(SamplingBody):
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ToolChoiceObject | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    background: bool | None = None
    previous_response_id: str | None = None
    conversation: Any = None
    prompt: Any = None

    UNSUPPORTED: ClassVar[dict[str, str]] = {
        "conversation": _NO_CONVERSATIONS,
        "prompt": "stored prompt templates are an OpenAI dashboard feature; send `instructions` and `input`"}

    def check_fields(self) -> None:
        super().check_fields()
        if self.background:
            raise unsupported("background", "the answer is made while the request waits (or streams); "
                                            "send background=false or leave it out")
        if self.choices != 1:
            raise unsupported("n", "a response holds one answer; send n to /v1/chat/completions for several")
        if isinstance(self.input, list) and not self.input:
            raise APIError(400, "input is an empty list; give a string or at least one item", param="input",
                           code="invalid_value")

    def _limit(self) -> int | None:
        return self.max_output_tokens or self.max_tokens

    def _constraints(self) -> list[tuple[str, Any, str]]:
        fmt = self.text.format if self.text is not None else None
        if fmt is None or fmt.type == "text":
            return super()._constraints()
        if fmt.type == "json_object":
            return [("text.format", {"type": "object"}, "json_schema")] + super()._constraints()
        if fmt.schema_ is None:
            raise APIError(400, "text.format of type json_schema needs a schema ({\"type\": \"json_schema\", "
                                "\"name\": ..., \"schema\": {...}})", param="text.format.schema",
                           code="invalid_value")
        return [("text.format.schema", fmt.schema_, "json_schema")] + super()._constraints()

    # ---- the chat core's inputs
    def chat_tools(self) -> list[tuple[str, dict]]:
        """The functions the model is offered, each with where the request has it, as OpenAI chat
        tool dicts: a namespace's under `namespace.name` (namespaced() maps them back). Tools the
        API's host would run are not offered: this server has none, and a client that lists them
        (Codex CLI lists web_search) still gets its functions called."""
        out = []
        for i, tool in enumerate(self.tools or ()):
            if tool.type == "function":
                out.append((f"tools.{i}", tool.as_chat(f"tools.{i}")))
            elif tool.type == "namespace":
                for j, member in enumerate(tool.tools or ()):
                    where = f"tools.{i}.tools.{j}"
                    if member.type != "function":
                        raise unsupported(f"{where}.type", f"tools of type {member.type!r} in a namespace; "
                                                           "it holds function tools")
                    out.append((where, member.as_chat(where, f"{tool.name}.{member.name}")))
            elif tool.type not in _skipped_logged:
                _skipped_logged.add(tool.type)
                log.warning("not offering tools of type %r to the model: this server runs no hosted tools",
                            tool.type)
        return out

    def namespaced(self) -> dict[str, tuple[str, str]]:
        """`namespace.name` as the model calls a namespace's function -> (namespace, name)."""
        return {f"{t.name}.{m.name}": (t.name, m.name) for t in self.tools or () if t.type == "namespace"
                for m in t.tools or ()}

    def chat_tool_choice(self) -> str | NamedToolChoice | None:
        choice = self.tool_choice
        if not isinstance(choice, ToolChoiceObject):
            return choice
        if choice.type != "function":
            raise unsupported("tool_choice.type",
                              f"tool_choice of type {choice.type!r}; send \"auto\", \"none\", \"required\" or "
                              "{\"type\": \"function\", \"name\": ...}")
        if choice.name is None:
            raise APIError(400, "tool_choice of type function needs the function's name",
                           param="tool_choice.name", code="invalid_value")
        return NamedToolChoice(type="function", function=NamedFunction(name=choice.name))

    def items(self) -> list:
        """`input` as a list of items."""
        return [MessageItem(role="user", content=self.input)] if isinstance(self.input, str) else self.input

    def input_items(self) -> list[dict]:
        """The request's own input items as the API lists them: each with an id, texts as parts."""
        out = []
        for item in self.items():
            shown = item.model_dump(exclude_none=True)
            if isinstance(item, MessageItem):
                if isinstance(item.content, str):
                    part = "output_text" if item.role == "assistant" else "input_text"
                    shown["content"] = [{"type": part, "text": item.content}]
                shown.setdefault("status", "completed")
            shown.setdefault("id", f"{_ID_PREFIX.get(item.type, 'item')}_{uuid.uuid4().hex}")
            out.append(shown)
        return out

    def messages(self, earlier: list = ()) -> list[dict]:
        """`instructions`, then the `earlier` items (the conversation previous_response_id ends; its
        instructions are not carried over), then `input`, as chat-template messages."""
        chat = [] if self.instructions is None else [ChatMessage(role="system", content=self.instructions)]
        calls: set[str] = set()
        numbered = [("previous_response_id", item) for item in earlier]
        for where, item in numbered + [(f"input.{i}", item) for i, item in enumerate(self.items())]:
            if isinstance(item, MessageItem):
                chat.append(ChatMessage(role=item.role, content=_text(item.content, f"{where}.content")))
            elif isinstance(item, FunctionCallItem):
                calls.add(item.call_id)
                name = f"{item.namespace}.{item.name}" if item.namespace else item.name
                _add_call(chat, ToolCall(id=item.call_id, function=FunctionCall(name=name, arguments=item.arguments)))
            elif isinstance(item, FunctionCallOutputItem):
                if item.call_id not in calls:
                    raise APIError(400, f"{where} answers call_id {item.call_id!r}, and no function_call item "
                                        "before it has that call_id; send the call first",
                                   param=f"{where}.call_id", code="invalid_value")
                chat.append(ChatMessage(role="tool", tool_call_id=item.call_id,
                                        content=_text(item.output, f"{where}.output")))
            elif item.type != "reasoning":
                raise unsupported(f"{where}.type",
                                  f"input items of type {item.type!r}; this server reads message, "
                                  "function_call, function_call_output and reasoning items: send the "
                                  "items themselves, not references to them")
        return [m.for_template("input") for m in chat]    # texts are strings by now

    def echoed(self, params: SamplingParams, stored: bool) -> dict:
        """The request fields a response object repeats, sampling as it was applied."""
        fmt = (self.text.format if self.text is not None else None) or TextFormat(type="text")
        choice = self.tool_choice or "auto"
        return {"instructions": self.instructions, "max_output_tokens": self.max_output_tokens,
                "parallel_tool_calls": self.parallel_tool_calls, "previous_response_id": self.previous_response_id,
                "temperature": params.temperature, "top_p": params.top_p, "store": stored,
                "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True)},
                "tool_choice": choice if isinstance(choice, str) else choice.model_dump(exclude_none=True),
                "tools": [t.model_dump(by_alias=True) for t in self.tools or ()], "truncation": "disabled",
                "metadata": self.metadata or {}, "user": self.user}


def _add_call(chat: list[ChatMessage], call: ToolCall) -> None:
    """A function_call item joins the assistant turn right before it (its text or earlier calls),
    else it opens an assistant turn of its own: the template writes a turn's calls together."""
    last = chat[-1] if chat else None
    if last is not None and last.role == "assistant":
        last.tool_calls = (last.tool_calls or []) + [call]
    else:
        chat.append(ChatMessage(role="assistant", content=None, tool_calls=[call]))
