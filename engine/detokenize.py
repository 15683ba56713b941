"""Incremental detokenization: text deltas that are UTF-8 safe and honour stop strings.

Guarantee: the concatenation of every delta and `finish()` equals `tokenizer.decode(all ids)`,
cut before the first stop string. Each push decodes only a short window of recent ids.

Why a window is enough: when the decoded text of ids[:j] ends in a complete character, that
character boundary is final (UTF-8 decoding resynchronises), so decode(ids) is decode(ids[:j]) +
decode(ids[j:]). Such a j becomes the window's new base. Only the last character of a window can
still change: an incomplete byte sequence at the end decodes as one U+FFFD that later bytes may
turn into a real character, so that one character is held back. Every earlier U+FFFD is an
invalid byte for good and is released at once. The window starts one base earlier than the text
it releases, so tokenizers whose decoders treat the first token specially (leading-space
stripping) decode the released part exactly as a full decode would.
"""
from __future__ import annotations

from typing import Protocol

REPLACEMENT_CHAR = "\ufffd"


class Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class _StopMatcher:
    """Cuts text at the first stop string; holds any tail that could still become one."""

    def __init__(self, stop: tuple[str, ...]):
        self.stop = tuple(s for s in stop if s)
        self.stopped = False
        self.matched: str | None = None     # the stop string that cut the text
        self._held = ""

    def feed(self, text: str, final: bool = False) -> str:
        """The part of held + `text` that is certain; `final`: no more text will come."""
        if self.stopped:
            return ""
        text = self._held + text
        found, stop = min(((i, s) for s in self.stop if (i := text.find(s)) >= 0), default=(None, None))
        # a stop that may still complete earlier than `found` decides first: wait for it
        undecided = len(text) if final else len(text) - self._partial_stop_length(text)
        if found is not None and found <= undecided:
            self.stopped, self.matched = True, stop
            self._held = ""
            return text[:found]
        self._held = text[undecided:]
        return text[:undecided]

    def _partial_stop_length(self, text: str) -> int:
        """Length of the longest tail of `text` that is a proper prefix of some stop string."""
        for n in range(min(len(text), max((len(s) for s in self.stop), default=1) - 1), 0, -1):
            tail = text[-n:]
            if any(len(s) > n and s.startswith(tail) for s in self.stop):
                return n
        return 0


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Decoder, stop: tuple[str, ...] = (), skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._stops = _StopMatcher(stop)
        self._ids: list[int] = []
        self._context = 0       # window start: an earlier base whose text was already released
        self._base = 0          # last proven character boundary (a token index)
        self._released = 0      # chars of decode(ids[context:]) already passed on
        self._parts: list[str] = []

    @property
    def stopped(self) -> bool:
        return self._stops.stopped

    @property
    def stop_sequence(self) -> str | None:
        """The stop string that ended the text, once one did."""
        return self._stops.matched

    @property
    def text(self) -> str:
        return "".join(self._parts)

    def push(self, token_ids: list[int]) -> str:
        """Add generated ids; returns the text that became certain (possibly "")."""
        if self.stopped or not token_ids:
            return ""
        self._ids.extend(token_ids)
        window = self._decode(self._context, len(self._ids))
        complete = not window.endswith(REPLACEMENT_CHAR)
        certain = len(window) if complete else len(window) - 1
        fresh = window[self._released:certain]
        if complete:  # len(ids) is a proven boundary: slide the window forward
            self._context, self._base = self._base, len(self._ids)
            self._released = len(self._decode(self._context, self._base))
        else:
            self._released = certain
        return self._emit(self._stops.feed(fresh))

    def finish(self) -> str:
        """End of generation: release whatever was held back."""
        if self.stopped:
            return ""
        window = self._decode(self._context, len(self._ids))
        tail, self._released = window[self._released:], len(window)
        return self._emit(self._stops.feed(tail, final=True))

    def _decode(self, start: int, end: int) -> str:
        if start >= end:
            return ""
        return self._tokenizer.decode(self._ids[start:end], skip_special_tokens=self._skip_special)

    def _emit(self, delta: str) -> str:
        if delta:
            self._parts.append(delta)
        return delta
