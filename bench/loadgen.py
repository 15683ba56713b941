"""The serving load generator: prompts, streams read on their own threads, token arrival times.

It drives `EngineLoop` (running on its thread) through the client API only: submit, iterate the
handle, cancel; so what it times is what a server's client would see.
"""
from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass, field

from engine.request import SamplingParams
from engine.stats import percentile
from models import PROMPT_ID_LIMIT


def random_prompts(count: int, length: int, seed: int = 0) -> list[list[int]]:
    """Distinct prompts of `length` ids the tiny bench tokenizer knows (ids 3.. below its limit)."""
    rng = random.Random(seed)
    return [[rng.randrange(3, PROMPT_ID_LIMIT) for _ in range(length)] for _ in range(count)]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


@dataclass
class StreamTrace:
    """One stream as its reader saw it: when it was submitted, when each delta arrived."""
    submitted: float
    arrivals: list[tuple[float, int]] = field(default_factory=list)    # (time, tokens in delta)
    finish_reason: object = None
    error: str | None = None

    @property
    def tokens(self) -> int:
        return sum(n for _, n in self.arrivals)

    def gaps(self, after: float = float("-inf"), until: float = float("inf")) -> list[float]:
        """Inter-token latencies whose second token arrived in (after, until]. A delta that carries
        k tokens (the reader fell behind) counts as k gaps of a k-th of the wait each."""
        out = []
        for (t0, _), (t1, n) in zip(self.arrivals, self.arrivals[1:]):
            if after < t1 <= until and n:
                out += [(t1 - t0) / n] * n
        return out


class Stream:
    """A submitted request and the thread that reads it to the end."""

    def __init__(self, loop, prompt: list[int], params: SamplingParams):
        self.trace = StreamTrace(submitted=time.perf_counter())
        self.handle = loop.submit(prompt, params)
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        for delta in self.handle:
            if delta.token_ids:
                self.trace.arrivals.append((time.perf_counter(), len(delta.token_ids)))
            if delta.finish_reason is not None:
                self.trace.finish_reason, self.trace.error = delta.finish_reason, delta.error

    def join(self, timeout: float | None = None) -> StreamTrace:
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"stream {self.handle.id} still running after {timeout} s")
        if self.trace.error:
            raise RuntimeError(f"stream {self.handle.id} failed: {self.trace.error}")
        return self.trace


@dataclass(frozen=True)
class LoadResult:
    streams: int
    output_tokens: int
    wall_s: float
    itl_p50_s: float | None
    itl_p99_s: float | None

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.wall_s


def run_concurrent(loop, prompts: list[list[int]], new_tokens: int, timeout_s: float = 1800) -> LoadResult:
    """Submit every prompt at once and read all streams to the end; aggregate output tok/s from
    the first submit to the last token."""
    start = time.perf_counter()
    streams = [Stream(loop, p, greedy(new_tokens)) for p in prompts]
    traces = [s.join(timeout_s) for s in streams]
    end = max(t.arrivals[-1][0] for t in traces)
    gaps = [g for t in traces for g in t.gaps()]
    return LoadResult(len(prompts), sum(t.tokens for t in traces), end - start,
                      percentile(gaps, 50), percentile(gaps, 99))


@dataclass(frozen=True)
class LatencyUnderPrefill:
    idle_gaps: list[float]          # streams' inter-token latencies before the long prompt came
    prefill_gaps: list[float]       # ... while it was prefilled (until its first token)
    prefill_s: float                # long prompt: submit to first token


def itl_while_prompt_arrives(loop, stream_prompts: list[list[int]], long_prompt: list[int],
                             idle_tokens: int, timeout_s: float = 1800) -> LatencyUnderPrefill:
    """Run the streams until each produced `idle_tokens` more tokens after all had started, then
    submit `long_prompt` (one new token) and record the streams' latencies until it answered."""
    streams = [Stream(loop, p, greedy(1 << 30)) for p in stream_prompts]   # clamped to the context
    deadline = time.perf_counter() + timeout_s
    try:
        _wait(lambda: all(s.trace.tokens >= 1 for s in streams), deadline)
        all_started = max(s.trace.arrivals[0][0] for s in streams)
        _wait(lambda: all(s.trace.tokens > idle_tokens for s in streams), deadline)
        long = Stream(loop, long_prompt, greedy(1))
        first_token = long.join(max(1.0, deadline - time.perf_counter())).arrivals[0][0]
    finally:
        for s in streams:
            s.handle.cancel()
    traces = [s.join(60) for s in streams]
    return LatencyUnderPrefill(
        idle_gaps=[g for t in traces for g in t.gaps(all_started, long.trace.submitted)],
        prefill_gaps=[g for t in traces for g in t.gaps(long.trace.submitted, first_token)],
        prefill_s=first_token - long.trace.submitted)


def _wait(condition, deadline: float) -> None:
    while not condition():
        if time.perf_counter() > deadline:
            raise TimeoutError("the load generator waited past its deadline for stream output")
        time.sleep(0.005)
