"""One chat choice's reply as the client sees it: the text split into reasoning, content and tool
calls while it streams (reasoning first, then tool calls within the answer). The non-streamed reply
runs the same pieces once over the whole text, so a stream always adds up to it."""
from __future__ import annotations

from dataclasses import dataclass, field

from server.reasoning import ReasoningDelta, ReasoningParser
from server.tool_call_parser import ParsedDelta, ToolCallDelta, ToolCallParser


@dataclass
class ChatPiece:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)


class ChatOutput:
    def __init__(self, reasoning: ReasoningParser | None = None, tools: ToolCallParser | None = None,
                 parallel: bool = True):
        self._reasoning = reasoning
        self._tools = tools
        self._parallel = parallel       # False: calls after the first are dropped

    @property
    def called(self) -> bool:
        return self._tools is not None and self._tools.calls > 0

    def feed(self, text: str, final: bool = False) -> ChatPiece:
        """The next generated text; `final`: the reply ends here (flush what was held back)."""
        split = ReasoningDelta(content=text)
        if self._reasoning is not None:
            split = self._reasoning.feed(text)
            if final:
                end = self._reasoning.finish()
                split = ReasoningDelta(split.reasoning + end.reasoning, split.content + end.content)
        parsed = ParsedDelta(content=split.content)
        if self._tools is not None:
            parsed = self._tools.feed(split.content)
            if final:
                end = self._tools.finish()
                parsed = ParsedDelta(parsed.content + end.content, parsed.tool_calls + end.tool_calls)
        calls = parsed.tool_calls if self._parallel else [c for c in parsed.tool_calls if c.index == 0]
        return ChatPiece(split.reasoning, parsed.content, calls)


def whole_calls(deltas: list[ToolCallDelta]) -> list[dict]:
    """A reply's call deltas folded into whole OpenAI tool calls (`id`, `type`, `function` with
    `name` and the JSON `arguments`), in call order."""
    calls: dict[int, dict] = {}
    for d in deltas:
        call = calls.setdefault(d.index, {"id": None, "type": "function",
                                          "function": {"name": None, "arguments": ""}})
        call["id"] = d.id or call["id"]
        call["function"]["name"] = d.name or call["function"]["name"]
        call["function"]["arguments"] += d.arguments
    return [calls[i] for i in sorted(calls)]
