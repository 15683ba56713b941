"""Streaming tool-call parsers: a model's generated text -> `content` and OpenAI `tool_calls`.

Models write their calls as tagged text (Hermes JSON for Qwen2.5/Qwen3, XML for Qwen3-Coder and
Qwen3.5), and the server has to turn that text into structured calls while it streams. A parser
takes the text piece by piece and emits only what no later text can change, so however the
reply is split, the outputs concatenate to exactly what the whole text at once gives. A
non-streamed reply is one `feed()` followed by `finish()`.
"""
from __future__ import annotations

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
