"""A chat request on its way to the engine, whatever API shape it came in: the tools it offers, the
prompt from the model's chat template, the grammar its reply must follow, and what splits each
choice's reply into reasoning, content and tool calls."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass

from engine.grammar import Grammar, GrammarError
from server.chat_output import ChatOutput
from server.engine_host import EngineHost
from server.errors import APIError
from server.reasoning import ReasoningParser, reply_reasoning
from server.tool_parsers import PARSERS
from server.tools import ToolRequest, call_grammar, lazy_call_grammar, lenient, parameters_schema, renders_tools

_TEMPLATE_OWN = ("messages", "add_generation_prompt", "tools")


@dataclass(frozen=True)
class Chat:
    prompt_ids: list[int]
    grammar: Grammar | None
    reasoning: str                  # where the reply starts (Grammar.reasoning); "" = no split
    tools: ToolRequest | None
    tool_format: str | None         # the parser replies are read with (tool_parsers.PARSERS)

    def output(self) -> ChatOutput:
        """A fresh splitter for one choice's reply."""
        parser = PARSERS.get(self.tool_format) if self.tools is not None else None
        return ChatOutput(ReasoningParser(self.reasoning == "inside") if self.reasoning else None,
                          parser(list(self.tools.tools)) if parser else None,
                          self.tools.parallel if self.tools is not None else True)


async def compile_grammar(host: EngineHost, grammar: Grammar, param: str) -> None:
    """Compile on a worker thread: a big schema takes a while and must stall neither the event
    loop nor the engine's steps. A grammar llguidance refuses is a 400 naming `param`."""
    try:
        await asyncio.to_thread(host.client.compile_grammar, grammar)
    except GrammarError as e:
        raise APIError(400, f"{param}: {e}", param=param, code="invalid_value") from None


async def prepare_chat(host: EngineHost, messages: list[dict], tools: ToolRequest | None,
                       requested: tuple[Grammar, str] | None, template_kwargs: dict | None,
                       prefill: str = "") -> Chat:
    """`messages` as chat templates read them; `requested`: the output grammar the request asks
    for and the param that asked (a forced tool call brings its own); `prefill`: text the reply
    starts with, written after the template's generation prompt (it is not part of the reply)."""
    tokenizer = host.require_client().tokenizer
    if tools is not None and not renders_tools(tokenizer):
        raise APIError(400, f"model {host.names[0]!r}: its chat template does not show tools to the "
                            "model, so it cannot call them; send the request without tools",
                       param="tools", code="unsupported_value")
    for i, tool in enumerate(tools.tools if tools else ()):   # a broken schema is refused even in auto
        await compile_grammar(host, Grammar.json_schema(lenient(parameters_schema(tool))),
                              f"tools.{i}.function.parameters")
    extra = dict(template_kwargs or {})
    clash = [k for k in _TEMPLATE_OWN if k in extra]
    if clash:
        raise APIError(400, f"chat_template_kwargs may not set {clash[0]!r}: the request's own field "
                            "sets it", param="chat_template_kwargs", code="invalid_value")
    try:   # templating and tokenizing a long conversation take a while: off the event loop
        text = await asyncio.to_thread(tokenizer.apply_chat_template, messages,
                                       tools=list(tools.tools) if tools else None, **extra)
    except Exception as e:  # noqa: BLE001 - the template's own refusal, for the client
        raise APIError(400, f"could not apply the chat template: {e}", param="messages") from None
    text += prefill
    reasoning = reply_reasoning(text) if host.reasoning_parser is not None else ""
    tool_format = host.tool_format
    grammar, param = requested if requested else (None, None)
    if tools is not None and tools.must_call:
        if grammar is not None:
            raise APIError(400, f"tool_choice asks for a tool call, and {param} for another output "
                                "format; give one of them", param="tool_choice", code="invalid_value")
        grammar, param = call_grammar(tool_format, tools, host.client.grammar_literal), "tool_choice"
    elif tools is not None and grammar is None:   # auto: the calls it opens are well-formed
        grammar, param = lazy_call_grammar(tool_format, tools, host.client.grammar_literal), "tools"
    if grammar is not None:
        if reasoning and not grammar.trigger:   # the reasoning stays free; the grammar holds the answer after it
            grammar = Grammar(grammar.kind, grammar.source, reasoning)
        await compile_grammar(host, grammar, param)
    return Chat(await asyncio.to_thread(tokenizer.encode, text), grammar, reasoning, tools, tool_format)
