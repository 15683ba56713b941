"""Constrained decoding with llguidance: what a request asks for (`Grammar`), the engine's compile
cache (`GrammarCompiler`) and one request's live state (`Matcher`). No torch here.

Each distinct grammar is compiled once and kept; a request gets a copy of the compiled matcher,
which costs microseconds. Front ends compile before they submit, on a thread of their own (the
server uses a worker thread), so the step thread only asks matchers for token masks and feeds them
the drawn tokens. The mask also decides when an end-of-sequence token may be drawn: only where the
grammar is complete. A grammar with a `trigger` is lazy: the reply is free until the model writes
that special token, and the grammar holds only what follows it (llama.cpp's lazy grammars; the
server makes tool calls well-formed in tool_choice auto this way).
"""
from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass

from engine.errors import UserError

KINDS = ("json_schema", "regex", "choice", "lark")
REASONING = ("", "inside", "optional")
THINK_TAGS = ("<think>", "</think>")
# Between JSON tokens: nothing, one space, or a newline and up to 20 indentation characters (what
# llama.cpp's JSON grammars allow). Unbounded whitespace lets a model run on in blanks until
# max_tokens; a schema's own "x-guidance" options override this.
JSON_OPTIONS = {"whitespace_pattern": r"(| |\n[ \t]{0,20})"}


class GrammarError(UserError, ValueError):
    """A grammar (JSON schema, regex, choice list or Lark grammar) cannot be compiled; the message
    says what is wrong with it."""


@dataclass(frozen=True)
class Grammar:
    """What a request's output must match. `source` is text: a JSON schema or choice list as JSON,
    a regex, or a grammar in llguidance's Lark syntax (GBNF is converted to it)."""
    kind: str
    source: str
    # a thinking model's reply may begin with reasoning that the grammar leaves free: "" = no,
    # "inside" = the prompt opened a <think> block, "optional" = the model may open one itself
    reasoning: str = ""
    # a special token (its text) after which the grammar applies, each time the model writes it;
    # free text around: "" = the grammar holds the whole reply
    trigger: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise GrammarError(f"grammar kind {self.kind!r} is not one of {', '.join(KINDS)}")
        if self.reasoning not in REASONING:
            raise GrammarError(f"reasoning {self.reasoning!r} is not one of {REASONING}")
        if self.trigger and self.reasoning:
            raise GrammarError("a grammar with a trigger leaves the reasoning free already; give one of them")

    @classmethod
    def json_schema(cls, schema: dict | bool | str) -> "Grammar":
        # property order is kept: it is the order the output writes the properties in
        text = schema if isinstance(schema, str) else json.dumps(schema, ensure_ascii=False)
        return cls("json_schema", text)

    @classmethod
    def choice(cls, options: list[str]) -> "Grammar":
        if not options or not all(isinstance(o, str) for o in options):
            raise GrammarError("a choice needs a non-empty list of strings")
        return cls("choice", json.dumps(options, ensure_ascii=False))

    def llguidance(self) -> str:
        """The grammar in llguidance's own form."""
        import llguidance

        try:
            if self.kind == "lark":    # Lark as llguidance reads it, or GBNF, converted
                return llguidance.grammar_from("grammar", self.source)
            if self.kind == "json_schema":
                return llguidance.LLMatcher.grammar_from_json_schema(self.source, defaults=JSON_OPTIONS)
            return llguidance.grammar_from(self.kind, self.source)
        except (ValueError, TypeError) as e:
            raise GrammarError(f"{self.kind.replace('_', ' ')} is not valid: {e}") from None


class Matcher:
    """One request's position in its grammar, advanced by every token the request draws."""

    __slots__ = ("_m",)
    dormant = False     # (LazyMatcher) no grammar holds the next draws

    def __init__(self, llmatcher) -> None:
        self._m = llmatcher

    def mask(self) -> bytes:
        """The tokens the grammar allows next, one bit per token id (little-endian 32-bit words)."""
        return self._m.compute_bitmask()

    def accept(self, token: int) -> bool:
        """Advance by a drawn token; False if the grammar refused it (see `error`)."""
        return self._m.consume_token(token)

    @property
    def done(self) -> bool:
        """The grammar is complete and allows nothing more (the output may end here)."""
        return self._m.is_stopped()

    @property
    def error(self) -> str:
        return self._m.get_error()


class LazyMatcher:
    """A lazy grammar's state: no mask until the trigger token is drawn, then the grammar's, until
    its match is complete and the reply is free again. Never `done`: free text may follow."""

    __slots__ = ("_compiled", "_trigger", "_active")
    done = False

    def __init__(self, compiled, trigger: int) -> None:
        self._compiled = compiled
        self._trigger = trigger
        self._active: Matcher | None = None

    @property
    def dormant(self) -> bool:
        return self._active is None

    def before_trigger(self, tokens: tuple[int, ...]) -> tuple[int, ...]:
        """`tokens` up to the trigger: draws past it would have been made without the grammar."""
        return tokens[:tokens.index(self._trigger)] if self._trigger in tokens else tokens

    def mask(self) -> bytes | None:
        return None if self._active is None else self._active.mask()

    def accept(self, token: int) -> bool:
        if self._active is None:
            if token == self._trigger:
                self._active = Matcher(self._compiled.deep_copy())
            return True
        if not self._active.accept(token):
            return False
        if self._active.done:
            self._active = None
        return True

    @property
    def error(self) -> str:
        return "" if self._active is None else self._active.error


class GrammarCompiler:
    """Compiles grammars for one tokenizer and keeps the latest `cache_size` of them. Thread-safe.
    Building its llguidance tokenizer holds the GIL (0.9 s for a 150k vocabulary), which would
    stall every running request: the engine builds the compiler while it loads, not while it serves."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: tuple[int, ...],
                 cache_size: int = 256) -> None:
        import llguidance

        self._tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size,
                                                 eos_token=list(eos_token_ids))
        self._cache_size = cache_size
        self._cache: OrderedDict[Grammar, object] = OrderedDict()
        self._lock = threading.Lock()

    def literal(self, text: str) -> str:
        """`text` in a Lark grammar: a quoted string, or the token itself when the tokenizer has
        `text` as one special token (llguidance matches those only by token, e.g. Qwen's
        `<tool_call>`, which the model writes as one token)."""
        token = self.special_token(text)
        return json.dumps(text) if token is None else f"<[{token}]>"

    def special_token(self, text: str) -> int | None:
        """The id of `text` where the tokenizer has it as one special token."""
        ids = self._tokenizer.tokenize_str(text, parse_special=True)
        return ids[0] if len(ids) == 1 and self._tokenizer.is_special_token(ids[0]) else None

    def compile(self, grammar: Grammar):
        """The compiled matcher for `grammar` (cached); GrammarError names what is wrong."""
        with self._lock:
            if grammar in self._cache:
                self._cache.move_to_end(grammar)
                return self._cache[grammar]
        import llguidance

        if grammar.trigger and self.special_token(grammar.trigger) is None:
            raise GrammarError(f"trigger {grammar.trigger!r} is not one special token of this tokenizer")
        source = grammar.llguidance()
        if grammar.reasoning:
            source = self._after_reasoning(source, grammar.reasoning)
        # the constructor drops the GIL while it builds the grammar: other threads go on
        matcher = llguidance.LLMatcher(self._tokenizer, source, log_level=0)
        if matcher.is_error():
            raise GrammarError(f"{grammar.kind.replace('_', ' ')} cannot be used: "
                               f"{matcher.get_error().strip()}")
        with self._lock:
            self._cache[grammar] = matcher
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return matcher

    def _after_reasoning(self, answer: str, mode: str) -> str:
        """`answer` (llguidance's form) preceded by a free <think>...</think> block: the reasoning
        runs unconstrained up to the end tag, then the grammar applies."""
        grammars = json.loads(answer)["grammars"] if answer.lstrip().startswith("{") else [
            {"lark_grammar": answer}]
        grammars[0]["name"] = "answer"
        start, end = (self.literal(tag) for tag in THINK_TAGS)
        rules = []
        if end.startswith("<["):    # a special token ends the free text by itself
            think = f"/(?s:.*)/ {end}"
        else:
            think, rules = "think", [f"think[suffix={end}]: /(?s:.*)/"]
        think += r" /[ \t\n]*/"
        top = f"start: ({start} {think})? @answer" if mode == "optional" else f"start: {think} @answer"
        return json.dumps({"grammars": [{"lark_grammar": "\n".join(["%llguidance {}", top, *rules])},
                                        *grammars]})

    def matcher(self, grammar: Grammar) -> Matcher | LazyMatcher:
        """A fresh matcher at the start of `grammar`."""
        compiled = self.compile(grammar)
        if grammar.trigger:
            return LazyMatcher(compiled, self.special_token(grammar.trigger))
        return Matcher(compiled.deep_copy())
