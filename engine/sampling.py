"""Turn the logits of sampling rows into tokens: penalties, logit bias, grammar masks, bans, then greedy
or seeded random draws.

A seeded row draws from a generator seeded by (seed, index of the token being drawn), so its tokens do
not depend on what else is in the batch, nor on a preemption that recomputes it, nor on speculation: a
verify row draws at each of its positions exactly as single-token rows would have, one token index
further each (engine/speculation.py decides which draws count).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.contracts import PlanRow
from engine.models.batch import on_device

_MASK64 = (1 << 63) - 1
ARGMAX_CHUNK = 128


def argmax(x: torch.Tensor) -> torch.Tensor:
    """`x.argmax(-1)`: the first index of the largest value, NaN counting as the largest, as torch has it.
    On CPUs in two vectorized passes, each chunk's maximum and then the first chunk's argmax: torch's own
    CPU argmax takes the values one at a time, many times slower than its amax over a vocabulary."""
    n = x.shape[-1]
    if x.device.type != "cpu" or n < 2 * ARGMAX_CHUNK:
        return x.argmax(-1)
    rows = x.reshape(-1, n)
    full = n - n % ARGMAX_CHUNK
    maxima = rows[:, :full].view(len(rows), -1, ARGMAX_CHUNK).amax(-1)
    if full < n:
        maxima = torch.cat([maxima, rows[:, full:].amax(-1, keepdim=True)], dim=1)
    start = maxima.argmax(-1) * ARGMAX_CHUNK
    # the last chunk may be short: its window repeats the last value, which can only tie after it
    window = (start[:, None] + torch.arange(ARGMAX_CHUNK)).clamp_(max=n - 1)
    return (start + rows.gather(1, window).argmax(-1)).view(x.shape[:-1])


@dataclass
class TokenCounts:
    """How often each token id occurs in a request's prompt + output (`seen`) and in its output
    alone: the penalties' inputs, kept up to date as tokens are fed instead of recounted."""
    seen: torch.Tensor      # int32 [vocab]
    output: torch.Tensor    # int32 [vocab]

    @classmethod
    def zeros(cls, vocab: int, device: torch.device) -> "TokenCounts":
        return cls(torch.zeros(vocab, dtype=torch.int32, device=device),
                   torch.zeros(vocab, dtype=torch.int32, device=device))

    def add(self, token_ids, prompt_tokens: int) -> None:
        """Count fed tokens (ids, or a tensor of them), the first `prompt_tokens` of which are prompt."""
        ids = on_device(token_ids, self.seen.device)
        ones = torch.ones(len(token_ids), dtype=torch.int32, device=self.seen.device)
        self.seen.index_add_(0, ids, ones)
        if prompt_tokens < len(token_ids):
            self.output.index_add_(0, ids[prompt_tokens:], ones[prompt_tokens:])


def _apply_penalties(logits: torch.Tensor, row: PlanRow, counts: TokenCounts) -> None:
    p = row.sampling
    if p.repetition_penalty != 1.0:
        seen = counts.seen > 0
        penalised = torch.where(logits > 0, logits / p.repetition_penalty, logits * p.repetition_penalty)
        logits.copy_(torch.where(seen, penalised, logits))
    if p.presence_penalty or p.frequency_penalty:
        out = counts.output.to(logits.dtype)
        logits -= p.frequency_penalty * out + p.presence_penalty * (out > 0).to(logits.dtype)


def allowed_tokens(mask: bytes, vocab: int, device: torch.device) -> torch.Tensor:
    """A grammar's token bitmask (engine/grammar.py Matcher.mask) as a bool tensor over the vocabulary."""
    bits = np.unpackbits(np.frombuffer(mask, dtype=np.uint8), bitorder="little")[:vocab]
    return torch.from_numpy(bits).to(device=device, dtype=torch.bool)


def _shape(logits: torch.Tensor, row: PlanRow, counts: TokenCounts | None) -> None:
    """In place on one row: penalties, logit bias, the grammar's mask, then the bans, which give
    way where they would leave nothing to draw (a complete grammar allows only EOS)."""
    p = row.sampling
    if p.penalized:
        _apply_penalties(logits, row, counts)
    if p.logit_bias:
        ids, bias = zip(*p.logit_bias)
        logits[list(ids)] += torch.tensor(bias, dtype=logits.dtype, device=logits.device)
    if row.allowed is not None:
        logits.masked_fill_(~allowed_tokens(row.allowed, logits.numel(), logits.device), float("-inf"))
    if row.banned_token_ids:
        banned = list(row.banned_token_ids)
        kept = logits[banned].clone()
        logits[banned] = float("-inf")
        if row.allowed is not None and not torch.isfinite(logits).any():
            logits[banned] = kept


def _filter(logits: torch.Tensor, row: PlanRow) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p on one row; returns probabilities."""
    p = row.sampling
    logits = logits / p.temperature
    if p.top_k > 0 and p.top_k < logits.numel():
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if p.min_p > 0:
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
    if p.top_p < 1.0:
        sorted_p, order = probs.sort(descending=True)
        # keep the smallest prefix whose mass reaches top_p (the first token always survives)
        drop = (sorted_p.cumsum(0) - sorted_p) >= p.top_p
        probs = probs.scatter(0, order[drop], 0.0)
    return probs


def _draw(probs: torch.Tensor, row: PlanRow, index: int, generator: torch.Generator | None) -> torch.Tensor:
    """A token with probability `probs` (unnormalised), on the device; a seeded row's depends on
    (seed, index) only."""
    if row.sampling.seed is not None:
        generator = torch.Generator(device=probs.device)
        generator.manual_seed((row.sampling.seed * 1_000_003 + index) & _MASK64)
    noise = torch.empty_like(probs).exponential_(generator=generator)
    return argmax(probs / noise)


@dataclass
class Draws:
    """A step's draws, still on the device until `host()` reads them (overlapped scheduling feeds
    them to the next step there): `tokens` holds every row's span of draws in row order."""
    tokens: torch.Tensor            # int64 [draws]
    rows: list[PlanRow]
    spans: list[range]
    logprobs: torch.Tensor | None   # the model's own, when a row asked for them

    def firsts(self) -> torch.Tensor:
        """Each row's first draw (the token after its last fed one), on the device."""
        return self.tokens[on_device([span.start for span in self.spans], self.tokens.device)]

    def host(self) -> list[list[tuple]]:
        """Each row's draws, each a (token, logprob, top_logprobs)."""
        tokens, out = self.tokens.tolist(), []
        for row, span in zip(self.rows, self.spans):
            n = row.sampling.logprobs
            draws = []
            for j in span:
                tok, top = tokens[j], ()
                if n is None:
                    draws.append((tok, None, ()))
                    continue
                if n:
                    vals, ids = self.logprobs[j].topk(n)
                    top = tuple(zip(ids.tolist(), vals.tolist()))
                draws.append((tok, float(self.logprobs[j, tok]), top))
            out.append(draws)
        return out


def draw(logits: torch.Tensor, rows: list[PlanRow], generator: torch.Generator | None = None,
         counts: list[TokenCounts | None] | None = None) -> Draws:
    """logits: fp32 `[draws, vocab]`, changed in place: one per row, 1 + num_draft for a verify row
    (its positions in order); `counts`: each penalised row's token counts. Logprobs are the model's
    own, before penalties, bias and masks."""
    want_logprobs = any(r.sampling.logprobs is not None for r in rows)
    logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None
    counts = counts or [None] * len(rows)
    spans, at = [], 0
    for row in rows:
        spans.append(range(at, at + 1 + row.num_draft))
        at += 1 + row.num_draft
    for row, span, count in zip(rows, spans, counts):   # rows drawing from the logits as they are skip this
        if row.sampling.shaped or row.banned_token_ids or row.allowed is not None:
            for j in span:      # a verify row is never penalised, banned or masked: bias alone applies
                _shape(logits[j], row, count)
    tokens = argmax(logits)                 # the greedy draws; the other rows' are replaced below
    for row, span in zip(rows, spans):
        if not row.sampling.greedy:
            for d, j in enumerate(span):
                tokens[j] = _draw(_filter(logits[j], row), row, row.sample_index + d, generator)
    return Draws(tokens, rows, spans, logprobs)


def sample(logits: torch.Tensor, rows: list[PlanRow], generator: torch.Generator | None = None,
           counts: list[TokenCounts | None] | None = None) -> list[list[tuple]]:
    """`draw`, read back: each row's draws, each a (token, logprob, top_logprobs)."""
    return draw(logits, rows, generator, counts).host()
