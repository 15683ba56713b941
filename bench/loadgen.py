"""The serving load generator: workloads (prompts, output length, arrival schedule), streams read on
their own threads, token arrival times, and the summary both this generator and the HTTP one
(bench/http_loadgen.py) report.

It drives `EngineLoop` through the client API only: submit, iterate the handle, cancel; so what it
times is what a server's client would see. The calling thread steps the engine (`EngineLoop.run`)
while a helper thread submits and the streams are read on threads of their own: a bench process has
run torch ops on its main thread, and a loop thread beside that thread's OpenMP pool runs slower
than the same loop in a server process (see `EngineLoop.run`).
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


def greedy(max_tokens: int, logprobs: int | None = None) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=logprobs)


@dataclass(frozen=True)
class Schedule:
    """When each stream is submitted: seconds after the run's start, ascending."""
    offsets: tuple[float, ...]

    @classmethod
    def burst(cls, streams: int) -> Schedule:
        return cls((0.0,) * streams)

    @classmethod
    def fixed_rate(cls, streams: int, per_s: float) -> Schedule:
        return cls(tuple(i / per_s for i in range(streams)))

    @classmethod
    def poisson(cls, streams: int, per_s: float, seed: int) -> Schedule:
        """Exponential gaps of mean 1/per_s; the first stream starts at once."""
        rng, at, out = random.Random(seed), 0.0, []
        for _ in range(streams):
            out.append(at)
            at += rng.expovariate(per_s)
        return cls(tuple(out))


@dataclass(frozen=True)
class Workload:
    """What a load run sends; the same object drives the in-process and the HTTP generator."""
    prompts: tuple[tuple[int, ...], ...]
    new_tokens: int
    schedule: Schedule
    # ask for the sampled token's logprob: then every token shows up in the stream even when its
    # text is empty (held-back UTF-8 bytes, or ids the tiny bench tokenizer cannot spell)
    logprobs: bool = False

    def __post_init__(self):
        if len(self.prompts) != len(self.schedule.offsets):
            raise ValueError(f"{len(self.prompts)} prompts but {len(self.schedule.offsets)} "
                             "schedule offsets: give one offset per prompt")

    @classmethod
    def burst(cls, prompts: list[list[int]], new_tokens: int, logprobs: bool = False) -> Workload:
        return cls(tuple(map(tuple, prompts)), new_tokens, Schedule.burst(len(prompts)), logprobs)

    def params(self) -> SamplingParams:
        return greedy(self.new_tokens, 0 if self.logprobs else None)

    def starts(self, start: float):
        """(prompt, submit time) in submit order, for a run that starts at `start`."""
        return sorted(((p, start + o) for p, o in zip(self.prompts, self.schedule.offsets)),
                      key=lambda item: item[1])


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


@dataclass(frozen=True)
class LoadResult:
    """A run's summary: aggregate output tok/s from the first submit to the last token, and
    time-to-first-token and inter-token latency percentiles over all streams.

    `steady_tok_s` is the decode rate once every stream is running: the tokens that arrived after
    the last stream's first token, over the time from then to the last token. How the prefills of a
    burst were batched (which moves TTFT and tok/s a lot) does not enter it; None when no token
    came after that moment."""
    streams: int
    output_tokens: int
    wall_s: float
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    itl_p50_s: float | None
    itl_p99_s: float | None
    steady_tok_s: float | None = None
    errors: tuple[str, ...] = ()

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s > 0 else 0.0

    @classmethod
    def of(cls, traces: list[StreamTrace]) -> LoadResult:
        served = [t for t in traces if t.arrivals]
        start = min((t.submitted for t in traces), default=0.0)
        end = max((t.arrivals[-1][0] for t in served), default=start)
        ttfts = [t.arrivals[0][0] - t.submitted for t in served]
        gaps = [g for t in served for g in t.gaps()]
        return cls(len(traces), sum(t.tokens for t in traces), end - start,
                   percentile(ttfts, 50), percentile(ttfts, 99),
                   percentile(gaps, 50), percentile(gaps, 99), _steady_tok_s(served, end),
                   tuple(t.error for t in traces if t.error))

    def summary(self) -> str:
        def ms(s: float | None) -> str:
            return "-" if s is None else f"{s * 1e3:.1f}"
        return (f"{self.streams} streams, {self.output_tokens} tokens in {self.wall_s:.2f} s: "
                f"{self.tok_s:.1f} tok/s; TTFT p50/p99 {ms(self.ttft_p50_s)}/{ms(self.ttft_p99_s)} ms; "
                f"ITL p50/p99 {ms(self.itl_p50_s)}/{ms(self.itl_p99_s)} ms; steady decode "
                f"{'-' if self.steady_tok_s is None else f'{self.steady_tok_s:.1f}'} tok/s; "
                f"{len(self.errors)} errors")


def _steady_tok_s(served: list[StreamTrace], end: float) -> float | None:
    """Tokens after the last stream's first token, per second until the last token (`end`)."""
    if not served:
        return None
    all_running = max(t.arrivals[0][0] for t in served)
    tokens = sum(n for t in served for at, n in t.arrivals if at > all_running)
    return tokens / (end - all_running) if tokens and end > all_running else None


class Stream:
    """A submitted request and the thread that reads it to the end."""

    def __init__(self, loop, prompt: list[int], params: SamplingParams):
        self.trace = StreamTrace(submitted=time.perf_counter())
        self.handle = loop.submit(list(prompt), params)
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


def stepping(loop, work, *args):
    """`work(*args)` on a helper thread while this thread steps `loop` (not started), until it ends."""
    done, out = threading.Event(), {}

    def call() -> None:
        try:
            out["value"] = work(*args)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the stepping thread below
            out["error"] = exc
        finally:
            done.set()
            loop.wake()

    helper = threading.Thread(target=call, name="loadgen", daemon=True)
    helper.start()
    loop.run(until=done)
    helper.join()
    if "error" in out:
        raise out["error"]
    return out["value"]


def run_workload(loop, workload: Workload, timeout_s: float = 1800) -> LoadResult:
    """Submit each prompt at its scheduled time and read all streams to the end."""
    return stepping(loop, _send_and_read, loop, workload, timeout_s)


def _send_and_read(loop, workload: Workload, timeout_s: float) -> LoadResult:
    streams, params = [], workload.params()
    for prompt, at in workload.starts(time.perf_counter()):
        time.sleep(max(0.0, at - time.perf_counter()))
        streams.append(Stream(loop, prompt, params))
    deadline = time.perf_counter() + timeout_s
    return LoadResult.of([s.join(max(0.0, deadline - time.perf_counter())) for s in streams])


def run_concurrent(loop, prompts: list[list[int]], new_tokens: int, timeout_s: float = 1800) -> LoadResult:
    """Every prompt submitted at once."""
    return run_workload(loop, Workload.burst(prompts, new_tokens), timeout_s)


@dataclass(frozen=True)
class LatencyUnderPrefill:
    idle_gaps: list[float]          # streams' inter-token latencies before the long prompt came
    prefill_gaps: list[float]       # ... while it was prefilled (until its first token)
    prefill_s: float                # long prompt: submit to first token


def itl_while_prompt_arrives(loop, stream_prompts: list[list[int]], long_prompt: list[int],
                             idle_tokens: int, timeout_s: float = 1800) -> LatencyUnderPrefill:
    """Run the streams until each produced `idle_tokens` more tokens after all had started, then
    submit `long_prompt` (one new token) and record the streams' latencies until it answered."""
    return stepping(loop, _itl_while_prompt_arrives, loop, stream_prompts, long_prompt, idle_tokens,
                    timeout_s)


def _itl_while_prompt_arrives(loop, stream_prompts, long_prompt, idle_tokens, timeout_s):
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
