"""Timing engine steps through the scheduler: pure decode steps (prime N decoders, then time `run_once`
calls that are each exactly one decode row per request) and one-chunk prefills. Shared by the benches."""
from __future__ import annotations

import statistics
import time

from loadgen import greedy, random_prompts


class Timed:
    """Calls `fn` and keeps each call's wall time: our own median, whatever pytest-benchmark's
    flags (--benchmark-disable runs once and keeps no stats)."""

    def __init__(self, fn):
        self.fn = fn
        self.times: list[float] = []

    def __call__(self, *args):
        t0 = time.perf_counter()
        out = self.fn(*args)
        self.times.append(time.perf_counter() - t0)
        return out

    @property
    def median(self) -> float:
        return statistics.median(self.times)


class Repeat:
    """pytest-benchmark's `pedantic`, for a test that times several runs (its fixture times one)."""

    @staticmethod
    def pedantic(fn, rounds: int, warmup_rounds: int = 0, iterations: int = 1) -> None:
        for _ in range((warmup_rounds + rounds) * iterations):
            fn()


def generated(loop) -> dict[str, int]:
    return {r.id: r.generated_tokens for r in loop.scheduler.stats().requests}


def prime_decoders(loop, batch: int, context: int, max_tokens: int, params=None) -> None:
    """Submit `batch` prompts of `context` tokens and step until every one is prefilled (has its first
    token): from then on each step is exactly one decode row per request. `params` replaces the
    greedy SamplingParams (their max_tokens must cover the steps to time)."""
    for prompt in random_prompts(batch, context, seed=batch):
        loop.submit(prompt, params or greedy(max_tokens), bounded=False)
    while True:
        loop.run_once()
        counts = generated(loop)
        if len(counts) == batch and min(counts.values()) >= 1:
            return


def time_decode(benchmark, loop, batch: int, context: int, max_tokens: int, steps: int, warmup: int = 2,
                params=None) -> Timed:
    """Time `steps` decode steps of `batch` requests (after `warmup`), check each was a pure decode,
    then cancel the requests; the loop stays usable. `params`: see prime_decoders."""
    prime_decoders(loop, batch, context, max_tokens, params)
    before = generated(loop)
    step = Timed(loop.run_once)
    benchmark.pedantic(step, rounds=steps, warmup_rounds=warmup, iterations=1)
    after = generated(loop)
    loop.stop()                 # no thread: cancels inline
    loop.run_until_idle()
    ran = len(step.times)       # warm-up included; one call with --benchmark-disable
    assert after == {rid: n + ran for rid, n in before.items()}, "a timed step was not a pure decode"
    assert loop.scheduler.stats().blocks_used == 0
    step.times = step.times[-steps:]
    return step


def prefill_once(loop, tokens: int, seed: int) -> None:
    """One step that prefills a fresh `tokens`-long prompt in a single chunk. Give each call its own seed:
    a repeated prompt would be served from the prefix cache."""
    loop.submit(random_prompts(1, tokens, seed=seed)[0], greedy(1), bounded=False)
    loop.run_once()
    if loop.scheduler.stats().running or loop.scheduler.has_work:
        raise RuntimeError(f"prefill {tokens}: the prompt did not fit one step; raise the runner's idle "
                           f"prefill budget or prefill fewer tokens")
