"""Hermes-style tool calls (Qwen2.5, Qwen3): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
also as a fenced JSON block or a bare object opening the reply. A tagged call streams as its arguments
object is written (the server's lazy grammar holds what follows the tag to a well-formed call); a
fenced or bare one, which no grammar holds, is parsed once it is whole, and is content if it is no
valid call."""
from __future__ import annotations

import json
import re

from server.tool_call_parser import CALL_END, CALL_START, ToolCallParser, held_tag_start


_HERMES_HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')
_BARE = ("", "")    # a bare object: no tags around it; its region ends where the object does


class HermesParser(ToolCallParser):
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Qwen2.5, Qwen3). Small models
    often write the same object in a Markdown code fence, or bare, instead (Qwen2.5-Coder-1.5B
    does both): a fenced block whose object names a tool is a call too, and so are such objects
    opening the reply, one after another; any other block or object stays content."""
    name = "hermes"
    BLOCKS = ((CALL_START, CALL_END), ("```json\n", "```"), ("```\n", "```"))

    def __init__(self, tools: list[dict]):
        super().__init__(tools)
        self._streaming: _ObjectEnd | None = None  # the open call's header is read: the buffer
                                                   # holds its arguments, scanned for their end
        self._sent = 0           # characters of the arguments already emitted
        self._bare_ok = True     # nothing but bare calls so far: an object here may be one too
        self._object_end: _ObjectEnd | None = None   # where the open bare or fenced object ends

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
        elif self._block[0] == CALL_START and self._read_header(region):
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

    def _step_outside(self, final: bool) -> bool:
        if self._bare_ok:
            body = self._buf.lstrip()
            if body.startswith("{"):
                self._held_ws = self._buf[:len(self._buf) - len(body)]
                self._buf, self._block, self._object_end = body, _BARE, _ObjectEnd()
                return True
            if body or final:
                self._bare_ok = False
        return super()._step_outside(final)

    def _block_region(self) -> tuple[str, bool]:
        if self._block is _BARE:
            end = self._object_end.scan(self._buf)
            return (self._buf, False) if end is None else (self._buf[:end], True)
        body = self._buf.lstrip()
        if self._block[0] == CALL_START or not body.startswith("{"):
            return super()._block_region()
        # a fence holding an object closes after it: a fence inside one of its strings (a file's
        # content written with Markdown in it) is part of the call
        self._object_end = self._object_end or _ObjectEnd()
        end = self._object_end.scan(body)
        if end is None:
            return self._buf, False
        after = len(self._buf) - len(body) + end
        close = self._buf.find(self._block[1], after)
        if close >= 0:
            return self._buf[:close], True
        return self._buf[:after + held_tag_start(self._buf[after:], self._block[1])], False

    def _leave_block(self, region: str, closed: bool) -> None:
        super()._leave_block(region, closed)
        self._object_end = None

    def _reject_block(self, region: str, closed: bool) -> None:
        self._bare_ok = False       # the reply has content: later objects are content too
        super()._reject_block(region, closed)

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
