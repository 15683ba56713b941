"""Turn the logits of sampling rows into tokens: penalties, bans, greedy or seeded random draws.

A seeded row draws from a generator seeded by (seed, index of the token being drawn), so its tokens do
not depend on what else is in the batch, nor on a preemption that recomputes it.
"""
from __future__ import annotations

import torch

from engine.contracts import PlanRow

_MASK64 = (1 << 63) - 1


def _apply_penalties(logits: torch.Tensor, row: PlanRow) -> torch.Tensor:
    p = row.sampling
    hist = torch.tensor(row.history, dtype=torch.long, device=logits.device)
    if p.repetition_penalty != 1.0 and hist.numel():
        seen = hist.unique()
        vals = logits[seen]
        logits[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    out = hist[row.num_prompt_tokens:]
    if out.numel() and (p.presence_penalty or p.frequency_penalty):
        counts = torch.bincount(out, minlength=logits.numel()).to(logits.dtype)
        logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


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


def _draw(probs: torch.Tensor, row: PlanRow, generator: torch.Generator | None) -> int:
    if row.sampling.seed is not None:
        generator = torch.Generator(device=probs.device)
        generator.manual_seed((row.sampling.seed * 1_000_003 + row.sample_index) & _MASK64)
    noise = torch.empty_like(probs).exponential_(generator=generator)
    return int((probs / noise).argmax())


def sample(logits: torch.Tensor, rows: list[PlanRow], generator: torch.Generator | None = None):
    """logits: fp32 `[len(rows), vocab]`. Returns one (token, logprob, top_logprobs) per row."""
    want_logprobs = any(r.sampling.logprobs is not None for r in rows)
    logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None
    plain = all(r.sampling.greedy and not r.sampling.penalized and not r.banned_token_ids
                for r in rows)
    if plain:
        tokens = logits.argmax(dim=-1).tolist()
    else:
        tokens = []
        for i, row in enumerate(rows):
            x = logits[i].clone()
            if row.sampling.penalized:
                x = _apply_penalties(x, row)
            if row.banned_token_ids:
                x[list(row.banned_token_ids)] = float("-inf")
            tokens.append(int(x.argmax()) if row.sampling.greedy
                          else _draw(_filter(x, row), row, generator))
    out = []
    for i, (row, tok) in enumerate(zip(rows, tokens)):
        n = row.sampling.logprobs
        if n is None:
            out.append((tok, None, ()))
            continue
        top = ()
        if n:
            vals, ids = logprobs[i].topk(n)
            top = tuple(zip(ids.tolist(), vals.tolist()))
        out.append((tok, float(logprobs[i, tok]), top))
    return out
