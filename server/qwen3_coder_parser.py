"""Qwen3-Coder / Qwen3.5 XML tool calls:
`<tool_call><function=NAME><parameter=P>VALUE</parameter>...</function></tool_call>`."""
from __future__ import annotations

import json

from server.tool_call_parser import (FUNCTION, FUNCTION_END, PARAMETER, PARAMETER_END, ToolCallParser,
                                     held_tag_start)


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
