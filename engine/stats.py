"""Scheduler statistics: a snapshot dataclass and the recorder of token rates and latencies.

Times come from the scheduler's injected clock, so tests drive them by hand.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Callable

from engine.request import Request


@dataclass(frozen=True)
class RequestRow:
    id: str
    state: str
    prompt_tokens: int
    generated_tokens: int
    blocks: int
    slot: int | None
    age_s: float
    client: str = ""
    tokens_per_s: float = 0.0       # generated tokens over the time since the first one

    @classmethod
    def of(cls, req: Request, now: float) -> "RequestRow":
        first, out = req.first_token_time, len(req.output_token_ids)
        rate = 0.0 if first is None or now <= first else (out - 1) / (now - first)
        return cls(req.id, req.state.value, len(req.prompt_token_ids), out, len(req.blocks),
                   req.state_slot, now - req.arrival_time, req.client, rate)


@dataclass(frozen=True)
class SchedulerStats:
    running: int                    # admitted and not paused (prefill + decode)
    waiting: int
    paused: int
    blocks_used: int
    blocks_free: int
    blocks_reserved: int
    blocks_total: int
    slots_used: int
    slots_total: int
    preemptions_total: int
    prompt_tokens_total: int        # prompt tokens computed, recomputation after preemption included
    generation_tokens_total: int
    prompt_tokens_per_s: float      # over the recorder's window (the last few seconds)
    generation_tokens_per_s: float
    ttft_p50_s: float | None        # over recent requests; None before the first sample
    itl_p50_s: float | None
    itl_p99_s: float | None
    requests: tuple[RequestRow, ...]
    # prefix cache: prompt tokens looked up at admission (recomputes after preemption included)
    # and how many of them were served from cached blocks
    prefix_cache_query_tokens: int = 0
    prefix_cache_hit_tokens: int = 0
    prefix_cache_hit_rate: float = 0.0    # hit / query tokens; 0.0 before the first lookup
    cached_blocks: int = 0                  # blocks whose K/V is indexed (held or idle)
    cache_evictions_total: int = 0          # idle cached blocks reused for other tokens
    checkpoints: int = 0                    # hybrid models: state slots holding a checkpoint
    checkpoint_hits_total: int = 0          # admissions that resumed from a checkpoint
    checkpoint_evictions_total: int = 0
    steps_total: int = 0                    # engine steps (plans executed) since start
    # speculative decoding: proposed tokens verified, how many of them were accepted, verify rows
    spec_proposed_tokens_total: int = 0
    spec_accepted_tokens_total: int = 0
    spec_verify_rows_total: int = 0

    @property
    def spec_acceptance_rate(self) -> float:
        """Accepted / proposed tokens; 0.0 before the first verify row."""
        return self.spec_accepted_tokens_total / max(1, self.spec_proposed_tokens_total)

    @property
    def spec_mean_acceptance_length(self) -> float:
        """Tokens a verify row produced on average: its accepted proposals plus the one draw
        after them (vLLM's mean acceptance length); 0.0 before the first verify row."""
        rows = self.spec_verify_rows_total
        return 1 + self.spec_accepted_tokens_total / rows if rows else 0.0


def percentile(samples, p: float) -> float | None:
    """Nearest-rank percentile (p in (0, 100]); None for no samples."""
    ordered = sorted(samples)
    if not ordered:
        return None
    return ordered[max(0, math.ceil(p / 100 * len(ordered)) - 1)]


MAX_STEP_SAMPLES = 1 << 16


class StatsRecorder:
    """Running totals plus recent samples: per-step token counts within `window_s`, and the last
    `max_samples` time-to-first-token and inter-token latencies."""

    def __init__(self, clock: Callable[[], float], window_s: float = 5.0,
                 max_samples: int = 1024) -> None:
        self._clock = clock
        self._window_s = window_s
        self._start = clock()
        # pruned by time only when rates are asked for, so a step's work never depends on how long the
        # last steps took; the bound caps what is kept while nobody asks (a minute of 1 ms steps)
        self._steps: deque[tuple[float, int, int]] = deque(maxlen=MAX_STEP_SAMPLES)
        self.ttft: deque[float] = deque(maxlen=max_samples)
        self.itl: deque[float] = deque(maxlen=max_samples)
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0

    def record_step(self, prompt_tokens: int, generation_tokens: int) -> None:
        self.prompt_tokens_total += prompt_tokens
        self.generation_tokens_total += generation_tokens
        self._steps.append((self._clock(), prompt_tokens, generation_tokens))

    def token_drawn(self, req) -> None:
        """A token of `req` is known now: its time to first token or its gap since the last one (a
        gap that includes a recompute after preemption is what the client saw)."""
        now = self._clock()
        if req.first_token_time is None:
            req.first_token_time = now
            self.ttft.append(now - req.arrival_time)
        else:
            self.itl.append(now - req.last_token_time)
        req.last_token_time = now

    def rates(self) -> tuple[float, float]:
        """(prompt tok/s, generation tok/s) over the window, or since start if that is shorter."""
        now = self._clock()
        self._forget_before(now - self._window_s)
        span = min(self._window_s, now - self._start)
        if span <= 0:
            return 0.0, 0.0
        return (sum(s[1] for s in self._steps) / span, sum(s[2] for s in self._steps) / span)

    def _forget_before(self, cutoff: float) -> None:
        while self._steps and self._steps[0][0] < cutoff:
            self._steps.popleft()
