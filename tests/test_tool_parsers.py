"""Tool-call and reasoning parsers: expected splits of whole replies, and the streaming guarantee
that however a reply is cut into pieces, the pieces' outputs concatenate to the whole reply's."""
from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass, field

import pytest

from server import reasoning, tool_parsers
from server.reasoning import ReasoningParser, reply_reasoning
from server.tool_call_parser import ParsedDelta
from server.tool_parsers import PARSERS, HermesParser, Qwen3CoderParser

TAGS = ("<tool_call>", "</tool_call>", "<function=", "<parameter=", "<think>", "</think>")


def _tool(name: str, properties: dict) -> dict:
    return {"type": "function", "function": {
        "name": name, "description": f"{name} tool",
        "parameters": {"type": "object", "properties": properties}}}


TOOLS = [
    _tool("get_weather", {"city": {"type": "string"}, "unit": {"type": "string"},
                          "days": {"type": "integer"}}),
    _tool("search", {"query": {"type": "string"}, "filters": {"type": "object"}}),
    _tool("configure", {"label": {"type": "string"}, "count": {"type": "integer"},
                        "ratio": {"type": "number"}, "enabled": {"type": "boolean"},
                        "options": {"type": "object"}, "tags": {"type": "array"},
                        "limit": {"type": ["integer", "null"]},
                        "note": {"type": ["string", "null"]},
                        "extra": {"description": "no type given"}}),
    _tool("write_file", {"path": {"type": "string"}, "content": {"type": "string"}}),
]


SAME = "<the reply unchanged>"  # expected content: the whole reply, byte for byte


@dataclass
class Case:
    id: str
    text: str
    content: str
    calls: list[tuple[str, str]] = field(default_factory=list)  # (name, exact arguments text)
    raw: bool = False  # the expected content holds tags on purpose (malformed call, stray tag)

    def __post_init__(self):
        self.content = self.text if self.content is SAME else self.content


W = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def splits(text: str) -> list[list[str]]:
    """Whole; two pieces at every position; one character at a time; a few random multi-cuts."""
    result = [[text]] + [[text[:i], text[i:]] for i in range(1, len(text))] + [list(text)]
    rng = random.Random(0)
    for _ in range(6):
        if len(text) < 3:
            break
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(2, min(12, len(text) - 1))))
        result.append([text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])])
    return result


@dataclass
class ToolRun:
    content: str
    calls: list[tuple[str, str]]    # (name, concatenated arguments) by index
    ids: list[list[str]]            # every id emitted, by index
    names: list[list[str]]          # every name emitted, by index
    first_has_id: list[bool]        # whether each call's first delta carried its id and name
    fragments: list[str]            # every emitted content and arguments piece
    counted: int                    # the parser's `calls`


def run_tools(parser_cls, pieces: list[str]) -> ToolRun:
    parser = parser_cls(TOOLS)
    deltas = [parser.feed(piece) for piece in pieces] + [parser.finish()]
    run = ToolRun("".join(d.content for d in deltas), [], [], [], [],
                  [d.content for d in deltas], parser.calls)
    for delta in (tc for d in deltas for tc in d.tool_calls):
        if delta.index == len(run.calls):  # a new call: indices appear in order
            run.calls.append(("", ""))
            run.ids.append([])
            run.names.append([])
            run.first_has_id.append(delta.id is not None and delta.name is not None)
        assert delta.index < len(run.calls), "call indices must appear in order"
        name, arguments = run.calls[delta.index]
        run.calls[delta.index] = (name + (delta.name or ""), arguments + delta.arguments)
        run.ids[delta.index] += [delta.id] if delta.id is not None else []
        run.names[delta.index] += [delta.name] if delta.name is not None else []
        run.fragments.append(delta.arguments)
    return run


def check_tool_case(parser_cls, case: Case) -> None:
    whole = run_tools(parser_cls, [case.text])
    assert whole.content == case.content
    assert whole.calls == case.calls
    for pieces in splits(case.text):
        run = run_tools(parser_cls, pieces)
        assert (run.content, run.calls) == (whole.content, whole.calls), pieces
        assert run.counted == len(run.calls)
        assert all(run.first_has_id)
        assert all(len(ids) == 1 and re.fullmatch(r"call_[0-9a-f]{24}", ids[0]) for ids in run.ids)
        assert all(len(names) == 1 for names in run.names)
        assert len({ids[0] for ids in run.ids}) == len(run.ids)
        if not case.raw:  # neither a piece nor what the pieces add up to holds a tag
            texts = run.fragments + [run.content] + [arguments for _, arguments in run.calls]
            assert not [t for t in texts if any(tag in t for tag in TAGS)], pieces


# ---------------------------------------------------------------- Hermes

NESTED_ARGS = ('{"query": "a } b }} c {", "filters": {"range": {"from": 1, "to": {"x": "}"}}, '
               '"list": [{}, {"y": "{ }"}]}}')
BAD_BODY = 'Sure.\n<tool_call>\n{name: get_weather}\n</tool_call>'
UNKNOWN = '<tool_call>\n{"name": "get_stock", "arguments": {"ticker": "ACME"}}\n</tool_call>'

HERMES_CASES = [
    Case("one_call",
         '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n'
         '</tool_call>',
         "", [("get_weather", '{"city": "Paris", "unit": "c"}')]),
    Case("text_before", "Let me check the weather.\n\n" + W,
         "Let me check the weather.", [("get_weather", '{"city": "Paris"}')]),
    # whitespace held after a call becomes content once text follows it
    Case("text_after", W + "\n\nI asked for the weather.",
         "\n\nI asked for the weather.", [("get_weather", '{"city": "Paris"}')]),
    Case("text_before_and_after", "One moment.\n" + W + "\nDone. \n",
         "One moment.\nDone.", [("get_weather", '{"city": "Paris"}')]),
    Case("two_calls",
         W + '\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "London", "unit": "f"}}'
         '\n</tool_call>\n',
         "", [("get_weather", '{"city": "Paris"}'),
              ("get_weather", '{"city": "London", "unit": "f"}')]),
    Case("three_calls",
         "I'll look these up.\n\n" + W
         + '\n\n<tool_call>\n{"name": "search", "arguments": {"query": "museums"}}\n</tool_call>'
         '<tool_call>{"name":"get_weather","arguments":{"city":"Rome","days":2}}</tool_call>',
         "I'll look these up.",
         [("get_weather", '{"city": "Paris"}'), ("search", '{"query": "museums"}'),
          ("get_weather", '{"city":"Rome","days":2}')]),
    Case("text_between_calls", "A" + W + "B" + W,
         "AB", [("get_weather", '{"city": "Paris"}'), ("get_weather", '{"city": "Paris"}')]),
    Case("unicode",
         '<tool_call>\n{"name": "search", "arguments": {"query": "Zürich → 東京 🚄", '
         '"filters": {"lang": "日本語"}}}\n</tool_call>',
         "", [("search", '{"query": "Zürich → 東京 🚄", "filters": {"lang": "日本語"}}')]),
    Case("nested_braces",
         '<tool_call>\n{"name": "search", "arguments": ' + NESTED_ARGS + '}\n</tool_call>',
         "", [("search", NESTED_ARGS)]),
    Case("empty_arguments_extra_spaces",
         '<tool_call>  {  "name" :  "search" ,  "arguments" :   { }  }  </tool_call>',
         "", [("search", "{ }")]),
    Case("keys_reversed",
         '<tool_call>\n{"arguments": {"city": "東京", "unit": "c"}, "name": "get_weather"}\n'
         '</tool_call>',
         "", [("get_weather", '{"city": "東京", "unit": "c"}')]),
    Case("arguments_as_json_string",
         '<tool_call>\n{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}\n'
         '</tool_call>',
         "", [("get_weather", '{"city": "Paris"}')]),
    # the header commits the call: what follows is passed through even though it is not JSON
    Case("broken_json_after_header",
         'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par\n</tool_call>',
         "Checking.", [("get_weather", '{"city": "Par')]),
    Case("malformed_body", BAD_BODY, SAME, raw=True),
    Case("unknown_tool", UNKNOWN, SAME, raw=True),
    Case("unknown_after_good", W + "\n" + UNKNOWN,
         "\n" + UNKNOWN, [("get_weather", '{"city": "Paris"}')], raw=True),
    Case("no_arguments_after_header",
         '<tool_call>{"name": "get_weather", "arguments": </tool_call>', SAME, raw=True),
    Case("missing_end_tag",
         'OK.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n',
         "OK.", [("get_weather", '{"city": "Paris"}')]),
    Case("stopped_inside_end_tag",
         '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_ca',
         "", [("get_weather", '{"city": "Paris"}')]),
    Case("missing_end_tag_keys_reversed",
         '<tool_call>\n{"arguments": {"city": "Paris"}, "name": "get_weather"}',
         "", [("get_weather", '{"city": "Paris"}')]),
    Case("stopped_mid_body", 'Hm.\n<tool_call>\n{"name": "get_we', SAME, raw=True),
    Case("plain_reply", "\n  Hello! No tools needed here.\n\n  ", SAME),
    Case("whitespace_only", " \n\t ", SAME),
    Case("empty", "", ""),
    Case("angle_brackets", "If a < b, use <tools> or <tool_call without a close, or <tool_c",
         SAME),
    Case("stray_end_tag", "Close it with </tool_call> later.", SAME, raw=True),
    # the object in a Markdown fence, as small Qwen2.5-Coder models write it
    Case("fenced_json_call",
         'Calling it.\n```json\n{\n  "name": "get_weather",\n  "arguments": {\n    "city": "Paris"\n  }\n}\n```',
         "Calling it.", [("get_weather", '{"city": "Paris"}')]),
    Case("keys_after_arguments",
         '<tool_call>\n{"name": "search", "arguments": {"query": "q"}, "reason": {"a": "}"}}\n</tool_call>',
         "", [("search", '{"query": "q"}')]),
    Case("fenced_plain_call", '```\n{"name": "search", "arguments": {"query": "x"}}\n```\nok',
         "\nok", [("search", '{"query": "x"}')]),
    # a fence closes after the object it holds, not at a fence inside one of its strings
    Case("fenced_call_with_a_fence_in_a_string",
         '```json\n{"name": "write_file", "arguments": {"path": "a.md", "content": "# A\\n```sh\\nls\\n```\\n"}}'
         '\n```\nSaved.', "\nSaved.", [("write_file", '{"path": "a.md", "content": "# A\\n```sh\\nls\\n```\\n"}')]),
    # no grammar holds a fenced call: one that is no valid JSON (as the 1.5B model wrote a file's
    # docstring, its quotes unescaped) stays content rather than a call with broken arguments
    Case("fenced_malformed_call_is_content",
         '```json\n{\n  "name": "write_file",\n  "arguments": {\n    "path": "a.py",\n    "content": '
         '"```python\n"""Doc."""\nx = {1: 2}\n```"\n  }\n}\n```', SAME),
    Case("fenced_code_is_content", "Here:\n```python\nprint('hi')\n```\n", SAME),
    Case("fenced_json_data_is_content", 'Data:\n```json\n{"name": "Bob", "age": 3}\n```', SAME),
    Case("fenced_json_list_is_content", '```json\n[1, 2, 3]\n```', SAME),
    Case("fenced_shell_is_content", "Run\n```\nls -la\n```\nthen.", SAME),
    Case("fenced_unknown_tool_is_content",
         '```json\n{"name": "get_stock", "arguments": {"t": "A"}}\n```', SAME),
    # a bare object opening the reply, as Qwen2.5-Coder-1.5B answers the OpenAI Agents SDK
    Case("bare_call", '{"name": "get_weather", "arguments": {"city": "Paris"}}',
         "", [("get_weather", '{"city": "Paris"}')]),
    Case("bare_calls_then_text",
         ' \n{"name": "get_weather", "arguments": {"city": "Rome"}}\n{"name": "search", "arguments": '
         '{"query": "}"}}\nDone.', "\nDone.", [("get_weather", '{"city": "Rome"}'), ("search", '{"query": "}"}')]),
    Case("bare_keys_reversed_is_content", '{"arguments": {"city": "Rome"}, "name": "get_weather"}', SAME),
    Case("bare_object_after_tagged_call_is_content", W + '\n{"name": "search", "arguments": {"query": "x"}}',
         '\n{"name": "search", "arguments": {"query": "x"}}', [("get_weather", '{"city": "Paris"}')]),
    Case("bare_data_is_content", ' {"name": "Bob", "age": 3}\n{"name": "search", "arguments": {}}', SAME),
    Case("bare_unknown_tool_is_content", '{"name": "get_stock", "arguments": {"t": "A"}}', SAME),
    Case("bare_unfinished_is_content", '{"name": "get_weather", "arguments": {"city": "Pa', SAME),
    Case("object_after_text_is_content", 'Call: {"name": "search", "arguments": {"query": "x"}}', SAME),
]


@pytest.mark.parametrize("case", HERMES_CASES, ids=lambda c: c.id)
def test_hermes(case):
    check_tool_case(HermesParser, case)


# ---------------------------------------------------------------- Qwen3-Coder XML

def xml_call(function: str, *params: tuple[str, str]) -> str:
    body = "".join(f"<parameter={name}>\n{value}\n</parameter>\n" for name, value in params)
    return f"<tool_call>\n<function={function}>\n{body}</function>\n</tool_call>"


CODE = 'def f(a, b):\n    if a < b:\n        return "<b>"\n    return a <= b\n'
UNKNOWN_XML = xml_call("get_stock", ("ticker", "ACME"))

XML_CASES = [
    Case("one_call", xml_call("get_weather", ("city", "Paris"), ("days", "3")),
         "", [("get_weather", '{"city": "Paris", "days": 3}')]),
    Case("two_calls",
         "Let me check both.\n\n" + xml_call("get_weather", ("city", "Paris")) + "\n"
         + xml_call("get_weather", ("city", "London"), ("unit", "f")),
         "Let me check both.",
         [("get_weather", '{"city": "Paris"}'), ("get_weather", '{"city": "London", "unit": "f"}')]),
    Case("typed_parameters",
         xml_call("configure", ("label", "  spaced label "), ("count", "42"), ("ratio", "0.25"),
                  ("enabled", "True"), ("options", '{"a": [1, 2],\n "b": null}'),
                  ("tags", '["x", "y"]'), ("limit", "5"), ("note", "hello"), ("extra", "7")),
         "", [("configure",
               '{"label": "  spaced label ", "count": 42, "ratio": 0.25, "enabled": true, '
               '"options": {"a": [1, 2], "b": null}, "tags": ["x", "y"], "limit": 5, '
               '"note": "hello", "extra": 7}')]),
    Case("typed_fallbacks",
         xml_call("configure", ("count", "many"), ("enabled", "yes"), ("ratio", "NaN"),
                  ("note", "3"), ("extra", "Paris"), ("label", "12")),
         "", [("configure",
               '{"count": "many", "enabled": "yes", "ratio": "NaN", "note": "3", '
               '"extra": "Paris", "label": "12"}')]),
    Case("code_value", xml_call("write_file", ("path", "a.py"), ("content", CODE)),
         "", [("write_file", json.dumps({"path": "a.py", "content": CODE}))]),
    Case("unicode", xml_call("get_weather", ("city", "Zürich 🏔 東京")),
         "", [("get_weather", '{"city": "Zürich 🏔 東京"}')]),
    Case("no_parameters", "<tool_call>\n<function=search>\n</function>\n</tool_call>",
         "", [("search", "{}")]),
    Case("missing_parameter_end",
         "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n<parameter=days>\n2\n"
         "</function>\n</tool_call>",
         "", [("get_weather", '{"city": "Paris", "days": 2}')]),
    # text between tags is dropped, and a stray "<" must not end the call early
    Case("stray_text_between_tags",
         "<tool_call>\n<function=get_weather>\n<x> note <parameter=city>\nParis</tool_call>",
         "", [("get_weather", '{"city": "Paris"}')]),
    Case("unknown_function", "Try:\n" + UNKNOWN_XML, SAME, raw=True),
    Case("unknown_after_good", xml_call("get_weather", ("city", "Paris")) + "\n" + UNKNOWN_XML,
         "\n" + UNKNOWN_XML, [("get_weather", '{"city": "Paris"}')], raw=True),
    Case("not_a_function", '<tool_call>\n{"name": "get_weather"}\n</tool_call>', SAME, raw=True),
    Case("finish_in_value", "<tool_call>\n<function=get_weather>\n<parameter=city>\nPar",
         "", [("get_weather", '{"city": "Par"}')]),
    Case("finish_in_parameter_end",
         "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</para",
         "", [("get_weather", '{"city": "Paris"}')]),
    Case("finish_in_next_tag",
         "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<param",
         "", [("get_weather", '{"city": "Paris"}')]),
    Case("finish_after_function_tag", "<tool_call>\n<function=get_weather>\n",
         "", [("get_weather", "{}")]),
    Case("finish_before_function_named", "<tool_call>\n<function=get_wea", SAME, raw=True),
    Case("plain_reply", "  a <b> c\n <tool_ca\n", SAME),
]


@pytest.mark.parametrize("case", XML_CASES, ids=lambda c: c.id)
def test_qwen3_coder(case):
    check_tool_case(Qwen3CoderParser, case)


@pytest.mark.parametrize("case", [c for c in HERMES_CASES + XML_CASES if c.calls],
                         ids=lambda c: c.id)
def test_well_formed_arguments_are_json(case):
    for _, arguments in case.calls:
        if case.id == "broken_json_after_header":  # the model's own broken text, passed through
            with pytest.raises(ValueError):
                json.loads(arguments)
        else:
            assert isinstance(json.loads(arguments), dict)


def test_arguments_decode_to_expected_values():
    by_id = {c.id: c for c in HERMES_CASES + XML_CASES}
    assert json.loads(by_id["nested_braces"].calls[0][1]) == {
        "query": "a } b }} c {",
        "filters": {"range": {"from": 1, "to": {"x": "}"}}, "list": [{}, {"y": "{ }"}]}}
    assert json.loads(by_id["typed_parameters"].calls[0][1]) == {
        "label": "  spaced label ", "count": 42, "ratio": 0.25, "enabled": True,
        "options": {"a": [1, 2], "b": None}, "tags": ["x", "y"], "limit": 5, "note": "hello",
        "extra": 7}
    assert json.loads(by_id["code_value"].calls[0][1])["content"] == CODE


def test_hermes_streams_arguments_before_the_call_ends():
    parser = HermesParser(TOOLS)
    first = parser.feed('Hi <tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa')
    assert first.content == "Hi"
    assert [(d.index, d.name, d.arguments) for d in first.tool_calls] == [
        (0, "get_weather", '{"city": "Pa')]
    closed = parser.feed('ris"} ')  # the arguments' own closing brace ends them at once
    assert [d.arguments for d in closed.tool_calls] == ['ris"}']
    # the outer brace, and keys a model adds after the arguments, are not part of the call
    assert parser.feed('}, "note": {"x": 1}}\n</tool_c') == ParsedDelta()
    assert parser.feed("all>") == ParsedDelta()
    assert parser.finish() == ParsedDelta()
    assert parser.calls == 1


def test_qwen3_coder_emits_each_parameter_when_it_closes():
    parser = Qwen3CoderParser(TOOLS)
    opened = parser.feed("<tool_call>\n<function=get_weather>\n<parameter=city>\nPar")
    assert [(d.name, d.arguments) for d in opened.tool_calls] == [("get_weather", "")]
    closed = parser.feed("is\n</parameter>\n")
    assert [d.arguments for d in closed.tool_calls] == ['{"city": "Paris"']
    ended = parser.feed("</function>\n</tool_call>")
    assert [d.arguments for d in ended.tool_calls] == ["}"]


def test_parser_registry_and_templates():
    assert PARSERS == {"hermes": HermesParser, "qwen3_coder": Qwen3CoderParser}
    assert tool_parsers.parser_for_template(None) is None
    assert tool_parsers.parser_for_template("{{ messages }}") is None
    assert tool_parsers.parser_for_template("<tool_call>\n{{ tool_call | tojson }}") == "hermes"
    assert tool_parsers.parser_for_template(
        "<tool_call>\n<function={{ name }}>\n") == "qwen3_coder"


# ---------------------------------------------------------------- reasoning

@dataclass
class ReasoningCase:
    id: str
    starts: bool
    text: str
    reasoning: str
    content: str
    raw: bool = False  # the expected output holds a tag on purpose


REASONING_CASES = [
    ReasoningCase("starts_inside", True, "The user wants X.\nOK.\n</think>\n\nHere is X.",
                  "The user wants X.\nOK.\n", "Here is X."),
    ReasoningCase("think_at_start", False, "<think>\nhmm, 1 < 2\n</think>\n\nAnswer.\n",
                  "\nhmm, 1 < 2\n", "Answer.\n"),
    ReasoningCase("whitespace_then_think", False, "\n <think>a</think>b", "a", "b"),
    ReasoningCase("no_think", False, "  Hello there.\n", "", "  Hello there.\n"),
    ReasoningCase("not_quite_think", False, " <thought> x", "", " <thought> x"),
    ReasoningCase("close_without_open", False, "a </think> b", "", "a </think> b", raw=True),
    ReasoningCase("finish_inside", True, "still thinking </thi", "still thinking </thi", ""),
    ReasoningCase("finish_inside_opened", False, "<think>deep < thought", "deep < thought", ""),
    ReasoningCase("empty_reasoning", True, "</think>\n\nHi", "", "Hi"),
    ReasoningCase("only_whitespace_after", False, "<think>x</think>\n\n", "x", ""),
    ReasoningCase("empty", False, "", "", ""),
    ReasoningCase("empty_inside", True, "", "", ""),
]


def run_reasoning(starts: bool, pieces: list[str]) -> tuple[str, str, list[str]]:
    parser = ReasoningParser(starts_in_reasoning=starts)
    deltas = [parser.feed(piece) for piece in pieces] + [parser.finish()]
    fragments = [d.reasoning for d in deltas] + [d.content for d in deltas]
    return "".join(d.reasoning for d in deltas), "".join(d.content for d in deltas), fragments


@pytest.mark.parametrize("case", REASONING_CASES, ids=lambda c: c.id)
def test_reasoning(case):
    reasoning_text, content, _ = run_reasoning(case.starts, [case.text])
    assert (reasoning_text, content) == (case.reasoning, case.content)
    for pieces in splits(case.text):
        reasoning_text, content, fragments = run_reasoning(case.starts, pieces)
        assert (reasoning_text, content) == (case.reasoning, case.content), pieces
        if not case.raw:
            assert not [f for f in fragments if any(tag in f for tag in TAGS)], pieces


def test_reasoning_close_tag_split_across_pieces():
    parser = ReasoningParser()
    assert parser.feed("<think>abc</th") == reasoning.ReasoningDelta(reasoning="abc")
    assert parser.feed("ink>\n") == reasoning.ReasoningDelta()
    assert parser.feed("def") == reasoning.ReasoningDelta(content="def")
    assert parser.finish() == reasoning.ReasoningDelta()


PROMPT = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize("prompt, expected", [
    (PROMPT + "<think>\n", "inside"),
    (PROMPT, "optional"),
    (PROMPT + "<think>\n\n</think>\n\n", ""),
    ("<|im_start|>assistant\n<think>\nx<|im_end|>\n" + PROMPT, "optional"),
    ("<think> without an assistant turn", "optional"),
    ("", "optional"),
])
def test_reply_reasoning(prompt, expected):
    assert reply_reasoning(prompt) == expected


def test_reasoning_parser_for_template():
    assert reasoning.parser_for_template(None) is None
    assert reasoning.parser_for_template("{{ messages }}") is None
    assert reasoning.parser_for_template("{{ '<think>\\n' }}") == "qwen3"
