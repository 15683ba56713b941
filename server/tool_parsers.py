"""Streaming tool-call parsers: a model's generated text -> `content` and OpenAI `tool_calls`.

Models write their calls as tagged text (Hermes JSON for Qwen2.5/Qwen3, XML for Qwen3-Coder and
Qwen3.5), and the server has to turn that text into structured calls while it streams. A parser
takes the text piece by piece and emits only what no later text can change, so however the
reply is split, the outputs concatenate to exactly what the whole text at once gives. A
non-streamed reply is one `feed()` followed by `finish()`.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import ClassVar

CALL_START = "<tool_call>"
CALL_END = "</tool_call>"
FUNCTION = "<function="
FUNCTION_END = "</function>"
PARAMETER = "<parameter="
PARAMETER_END = "</parameter>"


@dataclass
class ToolCallDelta:
    index: int                 # position of the call in this reply (parallel calls)
    id: str | None = None      # only on the call's first delta
    name: str | None = None    # only on the call's first delta
    arguments: str = ""        # the next fragment of the JSON-encoded arguments object


@dataclass
class ParsedDelta:
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


def held_tag_start(text: str, tag: str) -> int:
    """Where the tail of `text` that could still grow into `tag` begins; len(text) if none."""
    for start in range(max(0, len(text) - len(tag) + 1), len(text)):
        if tag.startswith(text[start:]):
            return start
    return len(text)


class ToolCallParser:
    """Text outside call blocks is content; a subclass reads the body of each block.

    A block is `<tool_call>...</tool_call>`, or another (opening, closing) pair in BLOCKS.
    Subclasses implement `_step_call`, which advances through the open block as far as the text
    allows and says whether it made progress.
    """
    name: ClassVar[str]
    BLOCKS: ClassVar[tuple[tuple[str, str], ...]] = ((CALL_START, CALL_END),)

    def __init__(self, tools: list[dict]):
        self._tools = {t["function"]["name"]: t["function"] for t in tools if "function" in t}
        self._buf = ""          # text received and not yet turned into output
        self._block: tuple[str, str] | None = None  # the buffer starts inside this kind of block
        self._held_ws = ""      # whitespace before the open block: content only if it is malformed
        self._calls = 0
        self._out = ParsedDelta()

    @property
    def calls(self) -> int:
        return self._calls

    def feed(self, text: str) -> ParsedDelta:
        self._buf += text
        return self._run(final=False)

    def finish(self) -> ParsedDelta:
        return self._run(final=True)

    def _run(self, final: bool) -> ParsedDelta:
        self._out = ParsedDelta()
        while self._step_call(final) if self._block else self._step_outside(final):
            pass
        return self._out

    def _step_call(self, final: bool) -> bool:
        raise NotImplementedError

    def _step_outside(self, final: bool) -> bool:
        found = [(i, block) for block in self.BLOCKS if (i := self._buf.find(block[0])) >= 0]
        if found:
            start, block = min(found)
            before = self._buf[:start]
            text = before.rstrip()
            self._out.content += text
            self._held_ws = before[len(text):]
            self._buf = self._buf[start + len(block[0]):]
            self._block = block
            return True
        if final:
            # whitespace after the last call only separates it from the end of the reply
            if self._calls == 0 or self._buf.strip():
                self._out.content += self._buf
            self._buf = ""
            return False
        # trailing whitespace may yet turn out to precede a call: hold it, and any partial tag
        text = self._buf[:min(held_tag_start(self._buf, opening) for opening, _ in self.BLOCKS)].rstrip()
        self._out.content += text
        self._buf = self._buf[len(text):]
        return False

    def _block_region(self) -> tuple[str, bool]:
        """The text known to lie inside the open block, and whether its closing tag closed it.

        Without the close tag, a tail that may be its start is left out, so the region only ever
        grows as text arrives: what is decided on it never has to be taken back.
        """
        closing = self._block[1]
        end = self._buf.find(closing)
        if end >= 0:
            return self._buf[:end], True
        return self._buf[:held_tag_start(self._buf, closing)], False

    def _leave_block(self, region: str, closed: bool) -> None:
        self._buf = self._buf[len(region) + len(self._block[1]):] if closed else ""
        self._block = None

    def _reject_block(self, region: str, closed: bool) -> None:
        """Not a call after all: the block goes to content exactly as the model wrote it."""
        raw = self._buf[:len(region) + len(self._block[1])] if closed else self._buf
        self._out.content += self._held_ws + self._block[0] + raw
        self._held_ws = ""
        self._leave_block(region, closed)

    def _open_call(self, name: str, arguments: str = "") -> None:
        """The open block is the next call; the whitespace before it was only layout."""
        call_id = f"call_{uuid.uuid4().hex[:24]}"
        self._out.tool_calls.append(ToolCallDelta(self._calls, call_id, name, arguments))
        self._calls += 1
        self._held_ws = ""

    def _arguments(self, text: str) -> None:
        if not text:
            return
        calls = self._out.tool_calls
        if calls and calls[-1].index == self._calls - 1:
            calls[-1].arguments += text
        else:
            calls.append(ToolCallDelta(self._calls - 1, arguments=text))


# The start of a call body whose arguments can be streamed as the model writes them.
_HERMES_HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')


class HermesParser(ToolCallParser):
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Qwen2.5, Qwen3). Small models
    often write the same object in a Markdown code fence instead (Qwen2.5-Coder-1.5B does): a
    fenced block whose object names a tool is a call too, any other fenced block stays content."""
    name = "hermes"
    BLOCKS = ((CALL_START, CALL_END), ("```json\n", "```"), ("```\n", "```"))

    def __init__(self, tools: list[dict]):
        super().__init__(tools)
        self._streaming: _ObjectEnd | None = None  # the open call's header is read: the buffer
                                                   # holds its arguments, scanned for their end
        self._sent = 0           # characters of the arguments already emitted

    def _step_call(self, final: bool) -> bool:
        region, closed = self._block_region()
        if self._block[0] != CALL_START and not self._streaming and _not_a_call(region):
            self._reject_block(region, closed)      # a code block: release it without waiting
            return True
        if self._streaming:
            # the arguments end with their own closing brace; what follows up to the block's end
            # (the outer brace, or keys a model adds after them) is not part of the call
            end = self._streaming.scan(region)
            arguments = region[:end] if end is not None else region.rstrip()
            self._arguments(arguments[self._sent:])
            self._sent = len(arguments)
            if not (closed or final):
                return False
            self._streaming = None
        elif self._read_header(region):
            return True
        elif closed or final:
            call = _parse_call_json(region, self._tools)
            if call is None:
                self._reject_block(region, closed)
                return True
            self._open_call(*call)
        else:
            return False
        self._leave_block(region, closed)
        return True

    def _read_header(self, region: str) -> bool:
        match = _HERMES_HEADER.match(region)
        # Wait for the arguments' first character: only then is the header's trailing whitespace
        # complete, and arguments written as a JSON string are left to the whole-body parse.
        if not match or region[match.end():match.end() + 1] != "{":
            return False
        name = _json_string(match.group(1))
        if name not in self._tools:
            return False
        self._open_call(name)
        self._buf = self._buf[match.end():]
        self._streaming, self._sent = _ObjectEnd(), 0
        return True


def _not_a_call(region: str) -> bool:
    """Whether fenced text already shows it is no `{"name": ...` object."""
    body = region.lstrip()
    if not body:
        return False
    if not body.startswith("{"):
        return True
    key = body[1:].lstrip()
    return bool(key) and not (key.startswith('"name"') or '"name"'.startswith(key))


class _ObjectEnd:
    """Finds where the JSON object at the start of a growing text ends, reading each character
    once however often it is asked: braces and brackets count outside strings only."""

    def __init__(self) -> None:
        self._at = self._depth = 0
        self._in_string = self._escaped = False
        self.end: int | None = None

    def scan(self, text: str) -> int | None:
        """Just past the object's closing brace, or None while it is open."""
        while self.end is None and self._at < len(text):
            ch = text[self._at]
            self._at += 1
            if self._in_string:
                self._escaped, self._in_string = (not self._escaped and ch == "\\",
                                                  self._escaped or ch != '"')
            elif ch == '"':
                self._in_string = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                self.end = self._at if self._depth == 0 else None
        return self.end


def _json_string(body: str) -> str | None:
    try:
        return json.loads(f'"{body}"')
    except ValueError:
        return None


def _parse_call_json(body: str, tools: dict[str, dict]) -> tuple[str, str] | None:
    """(name, arguments JSON) from a whole call body in any key order, or None if it is not one."""
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError):
        return None
    name = obj.get("name") if isinstance(obj, dict) else None
    if not isinstance(name, str) or name not in tools:
        return None
    arguments = obj.get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):
            return None
    if not isinstance(arguments, dict):
        return None
    return name, json.dumps(arguments, ensure_ascii=False)


# A parameter value ends at its close tag, or where the next tag shows the model forgot it.
_VALUE_ENDS = (PARAMETER_END, PARAMETER, FUNCTION_END)


class Qwen3CoderParser(ToolCallParser):
    """`<tool_call><function=NAME><parameter=P>VALUE</parameter>...</function></tool_call>`.

    Each parameter is emitted when its value is complete, typed by the tool's JSON schema.
    """
    name = "qwen3_coder"

    def __init__(self, tools: list[dict]):
        super().__init__(tools)
        self._function: str | None = None   # the open call's tool; the buffer starts after its tag
        self._parameter: str | None = None  # the parameter whose value the buffer starts with
        self._params = 0                    # parameters emitted for the open call
        self._function_closed = False       # its arguments are complete: only </tool_call> is left

    def _step_call(self, final: bool) -> bool:
        region, closed = self._block_region()
        if self._function is None:
            return self._read_function(region, closed, final)
        if self._function_closed:
            if not (closed or final):
                self._buf = self._buf[len(region):]  # stray text before </tool_call> is dropped
                return False
            self._function, self._params, self._function_closed = None, 0, False
            self._leave_block(region, closed)
            return True
        if self._parameter is not None:
            return self._read_value(region, closed, final)
        return self._read_between(region, closed, final)

    def _read_function(self, region: str, closed: bool, final: bool) -> bool:
        body = region.lstrip()
        end = body.find(">") if body.startswith(FUNCTION) else -1
        name = body[len(FUNCTION):end].strip() if end >= 0 else None
        if name in self._tools:
            self._open_call(name)
            self._function = name
            self._buf = self._buf[len(region) - len(body) + end + 1:]
            return True
        if closed or final:
            self._reject_block(region, closed)
            return True
        return False

    def _read_between(self, region: str, closed: bool, final: bool) -> bool:
        # text between tags is layout (or noise): everything before the next "<" is dropped
        lt = region.find("<")
        skip = lt if lt >= 0 else len(region)
        tag = region[skip:]
        end = tag.find(">") if tag.startswith(PARAMETER) else -1
        if end >= 0:
            self._parameter = tag[len(PARAMETER):end].strip()
            self._buf = self._buf[skip + end + 1:]
            return True
        if tag.startswith(FUNCTION_END):
            self._close_function()
            self._buf = self._buf[skip + len(FUNCTION_END):]
            return True
        if tag and not (tag.startswith(PARAMETER) or PARAMETER.startswith(tag)
                        or FUNCTION_END.startswith(tag)):
            self._buf = self._buf[skip + 1:]  # a "<" that starts no tag of ours
            return True
        if closed or final:  # the model ended the call without </function>
            self._close_function()
            self._buf = self._buf[len(region):]
            return True
        self._buf = self._buf[skip:]
        return False

    def _read_value(self, region: str, closed: bool, final: bool) -> bool:
        ends = [i for i in (region.find(tag) for tag in _VALUE_ENDS) if i >= 0]
        if ends:
            cut = min(ends)
            value = region[:cut]
            skip = cut + len(PARAMETER_END) if region.startswith(PARAMETER_END, cut) else cut
        elif closed:
            value, skip = region, len(region)
        elif final:  # cut off mid-value: keep what was written, less a partial tag
            value = region[:min(held_tag_start(region, tag) for tag in _VALUE_ENDS)]
            skip = len(region)
            if not value:  # cut off before any of its text: the parameter is dropped
                self._parameter = None
                return True
        else:
            return False
        self._emit_parameter(self._parameter, value)
        self._parameter = None
        self._buf = self._buf[skip:]
        return True

    def _emit_parameter(self, parameter: str, value: str) -> None:
        value = value.removeprefix("\n").removesuffix("\n")
        schema = (self._tools[self._function].get("parameters") or {}).get("properties") or {}
        prop = schema.get(parameter)
        declared = prop.get("type") if isinstance(prop, dict) else None
        separator = "{" if self._params == 0 else ", "
        key = json.dumps(parameter, ensure_ascii=False)
        self._arguments(f"{separator}{key}: {_typed_json(value, declared)}")
        self._params += 1

    def _close_function(self) -> None:
        self._arguments("}" if self._params else "{}")
        self._function_closed = True


_NOT_JSON = object()
_JSON_TYPES = {bool: {"boolean"}, int: {"integer", "number"}, float: {"number"},
               type(None): {"null"}, dict: {"object"}, list: {"array"}, str: {"string"}}


def _typed_json(value: str, declared: str | list | None) -> str:
    """A parameter's text as JSON. The model writes values bare, so the schema decides: strings
    stay as written; other types are parsed when they parse. With "string" among several types,
    a parsed value must fit one of the others; with no type, only a non-string parse is used."""
    types = {declared} if isinstance(declared, str) else set(declared or ())
    if types == {"string"}:
        return json.dumps(value, ensure_ascii=False)
    parsed = _loads(value, booleans="boolean" in types)
    fits = (not isinstance(parsed, str) if not types
            else "string" not in types or bool(_JSON_TYPES.get(type(parsed), set()) & types))
    return json.dumps(value if parsed is _NOT_JSON or not fits else parsed, ensure_ascii=False)


def _loads(value: str, booleans: bool) -> object:
    if booleans and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    try:
        return json.loads(value, parse_constant=_reject_constant)
    except (ValueError, RecursionError):  # not JSON, or nested too deep to be meant as JSON
        return _NOT_JSON


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not JSON")  # NaN and Infinity would make the arguments invalid


PARSERS: dict[str, type[ToolCallParser]] = {"hermes": HermesParser, "qwen3_coder": Qwen3CoderParser}


def parser_for_template(chat_template: str | None) -> str | None:
    """The parser name a chat template's tool-call format needs: "qwen3_coder" if the template
    contains "<function=", else "hermes" if it contains "<tool_call>", else None."""
    if not chat_template:
        return None
    if FUNCTION in chat_template:
        return "qwen3_coder"
    return "hermes" if CALL_START in chat_template else None
