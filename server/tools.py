"""Tools on the way in: which tools a request offers and must call, whether the model's chat template
can show them, and the grammars that make a reply a well-formed call (`tool_choice` required or a
named function) or each call a reply opens well-formed (auto), in the model's own call format
(server/tool_parsers.py reads it back)."""
from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

from engine.grammar import JSON_OPTIONS, Grammar
from server.errors import APIError
from server.tool_call_parser import CALL_END, CALL_START

_PROBE = "pagedserve_probe_tool"
_PROBE_SYSTEM = "pagedserve probe system text"
_probe_cache: dict[tuple[str, str], bool] = {}


@dataclass(frozen=True)
class ToolRequest:
    """The tools of one chat request as the rest of the server needs them."""
    tools: tuple[dict, ...]         # OpenAI tool dicts, for the template and the parser
    must_call: tuple[str, ...]      # names one of which the reply must call; () = free (auto)
    parallel: bool

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(t["function"]["name"] for t in self.tools)


def tool_request(tools: list[dict] | None, tool_choice, parallel: bool) -> ToolRequest | None:
    """None when the reply may not call tools (no tools, or tool_choice "none")."""
    named = getattr(tool_choice, "function", None)
    if not tools:
        if tool_choice in ("required",) or named is not None:
            raise APIError(400, "tool_choice asks for a tool call but the request has no tools",
                           param="tool_choice", code="invalid_value")
        return None
    if tool_choice == "none":
        return None
    names = [t["function"]["name"] for t in tools]
    if len(set(names)) != len(names):
        raise APIError(400, "two tools have the same name; tool names must be unique", param="tools",
                       code="invalid_value")
    if named is not None:
        if named.name not in names:
            raise APIError(400, f"tool_choice names {named.name!r}, which is not among the tools "
                                f"({', '.join(names)})", param="tool_choice", code="invalid_value")
        must = (named.name,)
    else:
        must = tuple(names) if tool_choice == "required" else ()
    return ToolRequest(tuple(tools), must, parallel)


def parameters_schema(tool: dict) -> dict:
    return tool["function"].get("parameters") or {"type": "object"}


# A tool's schema guides the model, and a forced call's grammar: keywords llguidance does not implement
# (propertyNames, ...) go unenforced there rather than refuse the request (Claude Code's tools use
# them); a schema that is wrong (a bad type, say) is still refused.
TOOL_JSON_OPTIONS = JSON_OPTIONS | {"lenient": True}


def lenient(schema: dict) -> dict:
    """`schema` to compile with TOOL_JSON_OPTIONS (its own x-guidance options over them)."""
    return schema | {"x-guidance": TOOL_JSON_OPTIONS | schema.get("x-guidance", {})}


def _probed(tokenizer, messages: list[dict], shown: Callable[[str], bool]) -> bool:
    """Whether the chat template, given `messages` and a probe tool, renders text that `shown` accepts;
    cached per template and messages. A template that raises accepts nothing."""
    key = (tokenizer.chat_template or "", json.dumps(messages))
    if key not in _probe_cache:
        tools = [{"type": "function", "function": {"name": _PROBE, "description": "probe",
                                                   "parameters": {"type": "object", "properties": {}}}}]
        try:
            text = tokenizer.apply_chat_template(messages, tools=tools)
        except Exception:  # noqa: BLE001 - the template's refusal is the answer
            text = ""
        _probe_cache[key] = shown(text)
    return _probe_cache[key]


def renders_tools(tokenizer) -> bool:
    """Whether the chat template shows the model the tools it is given."""
    return _probed(tokenizer, [{"role": "user", "content": "hi"}], lambda text: _PROBE in text)


def renders_tools_first(tokenizer) -> bool:
    """Whether the template, given an empty first system message and the system text as a second one,
    shows the tools before that text (some templates refuse a system message after the first)."""
    messages = [{"role": "system", "content": ""}, {"role": "system", "content": _PROBE_SYSTEM},
                {"role": "user", "content": "hi"}]
    return _probed(tokenizer, messages, lambda text: _PROBE_SYSTEM in text.partition(_PROBE)[2])


def call_grammar(fmt: str, request: ToolRequest, literal: Callable[[str], str]) -> Grammar:
    """A grammar whose every match is one call (or, with parallel calls, several) of a tool in
    `request.must_call`, with arguments that validate against the tool's schema. `literal(text)`
    writes a tag in the grammar (GrammarCompiler.literal: a string, or the tag's own token)."""
    # a model that writes the newline it would put between calls may still end after it
    repeat = ' ("\\n" call)* "\\n"?' if request.parallel else ' "\\n"?'
    body = _call_body(fmt, [t for t in request.tools if t["function"]["name"] in request.must_call], literal)
    if body is None:
        raise APIError(400, f"tool_choice needs a known tool-call format to enforce the call; this model's is "
                            f"{fmt!r} (set --tool-call-parser)", param="tool_choice", code="unsupported_value")
    return Grammar("lark", "\n".join(["%llguidance {}", f"start: call{repeat}",
                                      f'call: {literal(CALL_START)} body', *body]))


def lazy_call_grammar(fmt: str, request: ToolRequest, literal: Callable[[str], str]) -> Grammar | None:
    """For tool_choice auto: the reply stays free, and each call the model opens with the call tag is
    held to a well-formed call of an offered tool. None where the format or the tokenizer cannot say
    (the tag must be one special token, as Qwen's is)."""
    body = _call_body(fmt, list(request.tools), literal)
    if body is None or not literal(CALL_START).startswith("<["):
        return None
    return Grammar("lark", "\n".join(["%llguidance {}", "start: body", *body]), trigger=CALL_START)


def _call_body(fmt: str, tools: list[dict], literal: Callable[[str], str]) -> list[str] | None:
    """Lark rules: `body`, a call of one of `tools` after its opening tag, up to its closing tag;
    None for a format without calls to enforce."""
    close = literal(CALL_END)
    if fmt == "hermes":
        schema = {"anyOf": [{"type": "object",
                             "properties": {"name": {"const": t["function"]["name"]},
                                            "arguments": parameters_schema(t)},
                             "required": ["name", "arguments"], "additionalProperties": False}
                            for t in tools], "x-guidance": TOOL_JSON_OPTIONS}
        return [f'body: "\\n" %json {json.dumps(schema)} "\\n" {close}']
    if fmt == "qwen3_coder":
        rules = ['body: "\\n" (' + " | ".join(f"fn{i}" for i in range(len(tools))) + f") {close}"]
        for i, tool in enumerate(tools):
            rules += _xml_function(f"fn{i}", tool)
        return rules
    return None


def _xml_function(rule: str, tool: dict) -> list[str]:
    schema = parameters_schema(tool)
    props = schema.get("properties") or {}
    required = set(schema.get("required") or ())
    lines, parts = [], []
    for j, (param, sub) in enumerate(props.items()):
        name = f"{rule}p{j}"
        value = f"{name}v"
        kind = sub.get("type") if isinstance(sub, dict) else None
        enum = sub.get("enum") if isinstance(sub, dict) else None
        if enum and all(isinstance(e, str) for e in enum):
            lines.append(f"{value}: " + " | ".join(json.dumps(e) for e in enum))
            lines.append(f'{name}: "<parameter={param}>\\n" {value} "\\n</parameter>\\n"')
        elif kind == "string" or not isinstance(sub, dict):     # raw text, up to maxLength
            most = sub.get("maxLength") if isinstance(sub, dict) else None
            length = f"{{{sub.get('minLength', 0)},{most}}}" if isinstance(most, int) else "*"
            lines.append(f'{value}[suffix="\\n</parameter>\\n"]: /(?s:.{length})/')
            lines.append(f'{name}: "<parameter={param}>\\n" {value}')
        else:       # numbers, booleans, objects...: JSON, so the schema's bounds hold
            lines.append(f"{value}: %json {json.dumps(lenient(sub))}")
            lines.append(f'{name}: "<parameter={param}>\\n" {value} "\\n</parameter>\\n"')
        parts.append(name if param in required else f"{name}?")
    lines.insert(0, f'{rule}: "<function={tool["function"]["name"]}>\\n" {" ".join(parts)} "</function>\\n"')
    return lines
