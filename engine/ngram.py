"""Prompt-lookup proposals (n-gram speculation): the tokens that followed the latest earlier
occurrence of a request's last n tokens, in its prompt or its output. No torch, no weights.

Each request keeps an index from n-gram to the position after its latest occurrence, for every n in
[ngram_min, ngram_max]; tokens are indexed as they are appended, so a proposal costs a few dict
lookups whatever the context length (the prompt is indexed once, at the first proposal).
"""
from __future__ import annotations

from engine.request import Request


class NgramIndex:
    """Where each n-gram of a token list last ended, for n in [lo, hi]; fed the list as it grows."""

    def __init__(self, lo: int, hi: int) -> None:
        self.lo, self.hi = lo, hi
        self._last: dict[tuple[int, ...], int] = {}     # n-gram -> the position after it
        self._seen = 0                                  # tokens indexed

    def extend(self, tokens: list[int]) -> None:
        """Index the tokens appended since the last call. An n-gram is indexed once the token after
        it exists, so the list's own last n tokens never match themselves."""
        for end in range(max(self._seen, self.lo), len(tokens)):
            for n in range(self.lo, min(self.hi, end) + 1):
                self._last[tuple(tokens[end - n:end])] = end
        self._seen = len(tokens)

    def propose(self, tokens: list[int], k: int) -> tuple[int, ...]:
        """Up to k tokens that followed the latest earlier occurrence of the longest suffix that
        occurred before; () when none did."""
        self.extend(tokens)
        for n in range(min(self.hi, len(tokens)), self.lo - 1, -1):
            at = self._last.get(tuple(tokens[len(tokens) - n:]))
            if at is not None:
                return tuple(tokens[at:at + k])
        return ()


class NgramProposer:
    """One NgramIndex per request over its prompt + output (`Request.all_token_ids`)."""

    def __init__(self, ngram_min: int, ngram_max: int) -> None:
        self.ngram_min, self.ngram_max = ngram_min, ngram_max
        self._indexes: dict[str, NgramIndex] = {}

    def propose(self, req: Request, k: int) -> tuple[int, ...]:
        index = self._indexes.get(req.id)
        if index is None:
            index = self._indexes[req.id] = NgramIndex(self.ngram_min, self.ngram_max)
        return index.propose(req.all_token_ids, k)

    def forget(self, request_id: str) -> None:
        self._indexes.pop(request_id, None)
