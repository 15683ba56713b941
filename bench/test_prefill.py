"""Prefill and mixed steps: a fresh 512-token prompt in one chunk next to the machine's GEMM ceiling and
transformers' forward over the same prompt; and decode steps of 8 streams while a long prompt is
prefilled in the same steps, next to pure decode steps of those 8 streams."""
from __future__ import annotations

import gc
import itertools

import pytest

from decode_steps import Timed, generated, prefill_once, prime_decoders
from engine import LLM
from hf_baseline import hf_generate_s
from loadgen import greedy, random_prompts
from roofline import decoder_flops

CHUNK = 512             # the runner's idle prefill budget on CPUs: one chunk per step
ROUNDS = 3
DECODERS = 8
CONTEXT = 128
MIXED_STEPS = 6
MAX_MODEL_LEN = 1024


@pytest.fixture(scope="module")
def llm(bench_checkpoint, bench_dtype):
    llm = LLM(model=str(bench_checkpoint), dtype=bench_dtype, max_concurrency=DECODERS + 1,
              max_model_len=MAX_MODEL_LEN, kv_pool_tokens=(DECODERS + 2) * MAX_MODEL_LEN, threads=0)
    yield llm
    llm.close()
    del llm
    gc.collect()


def test_prefill_pagedserve(benchmark, llm, machine, bench_report):
    loop, seeds = llm.engine.loop, itertools.count(1000)
    step = Timed(lambda: prefill_once(loop, CHUNK, next(seeds)))
    benchmark.group = f"prefill {CHUNK}"
    benchmark.pedantic(step, rounds=ROUNDS, warmup_rounds=1, iterations=1)
    step.times = step.times[-ROUNDS:]
    flops = decoder_flops(llm.engine.model.cfg, tokens=CHUNK, attended=CHUNK * (CHUNK + 1) // 2, logit_rows=1)
    bench_report.add(f"prefill {CHUNK}", "pagedserve", CHUNK / step.median, "tok/s", subject=True,
                     note=f"median of {ROUNDS} one-chunk steps, {step.median * 1e3:.0f} ms, "
                          f"{flops / step.median / 1e9:.0f} GFLOP/s")
    bench_report.add(f"prefill {CHUNK}", "GEMM ceiling", machine.gemm_tok_s(flops=flops, tokens=CHUNK), "tok/s",
                     note=f"{flops / 1e9:.0f} GFLOP per chunk at the probe's rate")


def test_prefill_transformers(benchmark, hf_model, bench_report):
    """One `generate` of a single token: the forward over the prompt plus one sampling."""
    prompts = iter(random_prompts(ROUNDS + 1, CHUNK, seed=CHUNK))
    step = Timed(lambda: hf_generate_s(hf_model, [next(prompts)], 1))
    benchmark.group = f"prefill {CHUNK}"
    benchmark.pedantic(step, rounds=ROUNDS, warmup_rounds=1, iterations=1)
    step.times = step.times[-ROUNDS:]
    bench_report.add(f"prefill {CHUNK}", "transformers", CHUNK / step.median, "tok/s",
                     note=f"generate 1 token, median of {ROUNDS}, {step.median * 1e3:.0f} ms")


def test_mixed_steps(benchmark, llm, bench_report):
    """The same 8 streams' steps without and then with a long prompt being prefilled alongside: the
    cost a prompt's arrival puts on the running streams' inter-token latency."""
    loop = llm.engine.loop
    prime_decoders(loop, DECODERS, CONTEXT, max_tokens=MAX_MODEL_LEN)
    pure = Timed(loop.run_once)
    for _ in range(MIXED_STEPS):
        pure()
    loop.submit(random_prompts(1, MAX_MODEL_LEN - 64, seed=7)[0], greedy(1), bounded=False)
    mixed = Timed(loop.run_once)
    before, prompt_before = generated(loop), loop.scheduler.stats().prompt_tokens_total
    benchmark.group = "mixed steps"
    benchmark.pedantic(mixed, rounds=MIXED_STEPS, iterations=1)
    after, prompt_after = generated(loop), loop.scheduler.stats().prompt_tokens_total
    loop.stop()
    loop.run_until_idle()
    ran = len(mixed.times)
    assert all(after[rid] == n + ran for rid, n in before.items()), "a measured step skipped a decode row"
    per_step = (prompt_after - prompt_before) / ran
    assert per_step > 0, "the long prompt was not prefilled alongside the decoders"
    group = f"decode b={DECODERS} + prefill"
    bench_report.add(group, "mixed step", mixed.median * 1e3, "ms", subject=True,
                     note=f"{DECODERS} decode rows + {per_step:.0f} prompt tokens a step, median of {ran}")
    bench_report.add(group, "decode-only step", pure.median * 1e3, "ms",
                     note=f"the same {DECODERS} streams just before, median of {MIXED_STEPS}")
