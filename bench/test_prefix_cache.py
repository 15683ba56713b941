"""Second-turn time to first token with a 1,000-token history: prefix cache on next to off, same
weights, same run. Turn 2 is the history, turn 1's reply and a new user message; with the cache on
only the blocks past the cached history are computed."""
from __future__ import annotations

import gc
import statistics
import time

from engine import LLM
from loadgen import greedy, random_prompts

HISTORY = 1000
REPLY = 8
NEW_TOKENS = 24
ROUNDS = 3              # timed second turns per setting, each with a different new message
MAX_MODEL_LEN = 1280


def _second_turn_ttft(checkpoint, prefix_cache: bool) -> list[float]:
    llm = LLM(model=str(checkpoint), dtype="auto", max_concurrency=1, max_model_len=MAX_MODEL_LEN,
              kv_pool_tokens=4 * MAX_MODEL_LEN, prefix_cache=prefix_cache, threads=0)
    try:
        [history] = random_prompts(1, HISTORY, seed=1)
        llm.generate([[5] * 32], greedy(2))                        # first-call costs stay out
        reply = llm.generate([history], greedy(REPLY))[0].token_ids
        times = []
        for message in random_prompts(ROUNDS, NEW_TOKENS, seed=2):
            t0 = time.perf_counter()
            llm.generate([history + reply + message], greedy(1))  # one token: the wall time is TTFT
            times.append(time.perf_counter() - t0)
        return times
    finally:
        llm.close()
        del llm
        gc.collect()


def _report(bench_report, checkpoint, label: str) -> None:
    on = statistics.median(_second_turn_ttft(checkpoint, True))
    off = statistics.median(_second_turn_ttft(checkpoint, False))
    group = f"2nd-turn TTFT, {HISTORY}-token history, {label}"
    note = f"median of {ROUNDS}; +{REPLY} reply +{NEW_TOKENS} new tokens"
    bench_report.add(group, "prefix cache on", on, "s", subject=True, note=note)
    bench_report.add(group, "prefix cache off", off, "s", note=f"speedup {off / on:.1f}x")


def test_second_turn_ttft_with_prefix_cache(bench_checkpoint, bench_report):
    _report(bench_report, bench_checkpoint, "dense")


def test_second_turn_ttft_with_prefix_cache_hybrid(bench_report):
    """Qwen3.5-shaped: the hit resumes the recurrent state from a block-aligned checkpoint."""
    from test_hybrid_context import _checkpoint

    _report(bench_report, _checkpoint(), "Qwen3.5-shaped hybrid")
