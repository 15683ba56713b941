"""Splits a thinking model's reply into `reasoning_content` and `content`, piece by piece.

Qwen3-style models reason inside <think>...</think> before they answer, and some chat templates
open that block in the prompt, so the reply starts inside it. As with the tool-call parsers, the
output never depends on how the reply was split into pieces: streamed or whole, it is the same.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from server.tool_call_parser import held_tag_start

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
_ASSISTANT_TURN = "<|im_start|>assistant"


class _State(Enum):
    START = "start"          # may still open with optional whitespace + <think>
    REASONING = "reasoning"  # inside the block
    AFTER = "after"          # just past </think>: whitespace there is layout, dropped
    CONTENT = "content"      # the answer: passed through


@dataclass
class ReasoningDelta:
    reasoning: str = ""
    content: str = ""


class ReasoningParser:
    """<think>...</think> splitting for Qwen3-style thinking models."""

    def __init__(self, starts_in_reasoning: bool = False):
        self._state = _State.REASONING if starts_in_reasoning else _State.START
        self._buf = ""  # text received and not yet turned into output

    def feed(self, text: str) -> ReasoningDelta:
        self._buf += text
        return self._run(final=False)

    def finish(self) -> ReasoningDelta:
        return self._run(final=True)

    def _run(self, final: bool) -> ReasoningDelta:
        out = ReasoningDelta()
        while self._step(out, final):
            pass
        return out

    def _step(self, out: ReasoningDelta, final: bool) -> bool:
        if self._state is _State.START:
            return self._step_start(final)
        if self._state is _State.REASONING:
            return self._step_reasoning(out, final)
        if self._state is _State.AFTER:
            text = self._buf.lstrip()
            self._buf = text
            if text:
                self._state = _State.CONTENT
            return bool(text)
        out.content += self._buf
        self._buf = ""
        return False

    def _step_start(self, final: bool) -> bool:
        text = self._buf.lstrip()
        if text.startswith(THINK_OPEN):
            self._buf = text[len(THINK_OPEN):]
            self._state = _State.REASONING
            return True
        if THINK_OPEN.startswith(text) and not final:
            return False  # could still become <think>: wait
        self._state = _State.CONTENT  # a reply without reasoning, kept exactly as written
        return True

    def _step_reasoning(self, out: ReasoningDelta, final: bool) -> bool:
        end = self._buf.find(THINK_CLOSE)
        if end >= 0:
            out.reasoning += self._buf[:end]
            self._buf = self._buf[end + len(THINK_CLOSE):]
            self._state = _State.AFTER
            return True
        cut = len(self._buf) if final else held_tag_start(self._buf, THINK_CLOSE)
        out.reasoning += self._buf[:cut]
        self._buf = self._buf[cut:]
        return False


def reply_reasoning(prompt_text: str) -> str:
    """Where the reply starts, judged from the prompt's last assistant turn (as Grammar.reasoning
    names it): "inside" when the template opened a <think> block there, "" when it wrote a closed
    one (thinking is off for this reply, e.g. enable_thinking=false), "optional" when there is no
    block yet (the model may open one itself)."""
    turn = prompt_text.rfind(_ASSISTANT_TURN)
    opened = prompt_text.find(THINK_OPEN, turn) if turn >= 0 else -1
    if opened < 0:
        return "optional"
    return "" if THINK_CLOSE in prompt_text[opened:] else "inside"


def parser_for_template(chat_template: str | None) -> str | None:
    """"qwen3" if the template mentions "<think>", else None."""
    return "qwen3" if chat_template and THINK_OPEN in chat_template else None
