"""Serving load through the streaming API (streams read on their own threads): aggregate output
tok/s at several concurrencies next to a transformers static batch of the same size, and the
inter-token latency of running streams while a long prompt is prefilled."""
from __future__ import annotations

import gc

import pytest

from engine import LLM
from engine.stats import percentile
from hf_baseline import hf_generate_s
from loadgen import greedy, itl_while_prompt_arrives, random_prompts, run_concurrent

CONCURRENCY = (1, 4, 8, 16)
PROMPT_LEN = 128
LONG_PROMPT_LEN = 2000
ITL_STREAMS = 4
ITL_IDLE_TOKENS = 16        # per stream, before the long prompt arrives
MAX_MODEL_LEN = 2304        # the long prompt plus room; every run here fits 8,192 pooled tokens
KV_POOL_TOKENS = 8192


@pytest.fixture(scope="module")
def serving_loop(bench_checkpoint, bench_dtype):
    llm = LLM(model=str(bench_checkpoint), dtype=bench_dtype, max_concurrency=max(CONCURRENCY),
              max_model_len=MAX_MODEL_LEN, kv_pool_tokens=KV_POOL_TOKENS, threads=0)
    llm.generate(random_prompts(1, 16, seed=99), greedy(2))         # first-call costs
    yield llm.engine.loop
    llm.close()
    del llm
    gc.collect()


@pytest.mark.parametrize("concurrency", CONCURRENCY)
def test_serving_pagedserve(benchmark, serving_loop, bench_report, bench_new_tokens, concurrency):
    prompts = random_prompts(concurrency, PROMPT_LEN, seed=concurrency)
    benchmark.group = f"serving c={concurrency}"
    result = benchmark.pedantic(run_concurrent, args=(serving_loop, prompts, bench_new_tokens),
                                rounds=1, iterations=1)
    assert result.output_tokens == concurrency * bench_new_tokens
    benchmark.extra_info.update(tok_s=result.tok_s, itl_p50_ms=(result.itl_p50_s or 0) * 1e3)
    note = f"{PROMPT_LEN}-token prompts, {bench_new_tokens} new, streamed, first submit to last token"
    if result.itl_p50_s is not None:
        note += f", ITL p50 {result.itl_p50_s * 1e3:.0f} ms"
    bench_report.add(f"serving c={concurrency}", "pagedserve", result.tok_s, "tok/s",
                     subject=True, note=note)


@pytest.mark.parametrize("concurrency", CONCURRENCY)
def test_serving_transformers(benchmark, hf_model, bench_report, bench_new_tokens, concurrency):
    prompts = random_prompts(concurrency, PROMPT_LEN, seed=concurrency)
    benchmark.group = f"serving c={concurrency}"
    seconds = benchmark.pedantic(hf_generate_s, args=(hf_model, prompts, bench_new_tokens),
                                 rounds=1, iterations=1)
    tok_s = concurrency * bench_new_tokens / seconds
    benchmark.extra_info.update(tok_s=tok_s)
    bench_report.add(f"serving c={concurrency}", "transformers", tok_s, "tok/s",
                     note="static batch generate, same prompts")


def test_itl_while_long_prompt_arrives(benchmark, serving_loop, bench_report):
    streams = random_prompts(ITL_STREAMS, PROMPT_LEN, seed=7)
    long_prompt = random_prompts(1, LONG_PROMPT_LEN, seed=8)[0]
    benchmark.group = "itl"
    result = benchmark.pedantic(itl_while_prompt_arrives,
                                args=(serving_loop, streams, long_prompt, ITL_IDLE_TOKENS),
                                rounds=1, iterations=1)
    assert len(result.idle_gaps) >= ITL_STREAMS * (ITL_IDLE_TOKENS - 1)
    assert result.prefill_gaps, "no stream produced a token while the long prompt was prefilled"
    during = f"{ITL_STREAMS} streams + {LONG_PROMPT_LEN:,}-token prefill"
    idle = f"{ITL_STREAMS} streams idle"
    for p in (50, 99):
        group = f"ITL p{p}"
        bench_report.add(group, during, percentile(result.prefill_gaps, p) * 1e3, "ms", subject=True,
                         note=f"{len(result.prefill_gaps)} gaps, prefill took {result.prefill_s:.1f} s")
        bench_report.add(group, idle, percentile(result.idle_gaps, p) * 1e3, "ms",
                         note=f"{len(result.idle_gaps)} gaps")
    benchmark.extra_info.update(
        idle_p50_ms=percentile(result.idle_gaps, 50) * 1e3,
        prefill_p50_ms=percentile(result.prefill_gaps, 50) * 1e3,
        prefill_p99_ms=percentile(result.prefill_gaps, 99) * 1e3, prefill_s=result.prefill_s)
