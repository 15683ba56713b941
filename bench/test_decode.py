"""Decode step time at batch 1, 8 and 32 (context ~128): ours through the scheduler and runner, next to
transformers `generate` on the same weights (batch 1 and 8), the machine's bandwidth roofline and, for
the batches where compute binds, its GEMM ceiling."""
from __future__ import annotations

import gc
import statistics

import pytest

from decode_steps import Timed, time_decode
from engine import LLM
from hf_baseline import hf_generate_s
from loadgen import random_prompts
from roofline import decoder_flops

BATCHES = (1, 8, 32)
HF_BATCHES = (1, 8)     # the targets compare 32 streams with the GEMM ceiling, not with transformers
CONTEXT = 128
OUR_STEPS = 10          # timed decode steps (after 2 warm-up steps)
HF_STEPS = 16           # decode steps inside one transformers generate
HF_ROUNDS = 2
MAX_MODEL_LEN = 512


@pytest.fixture(scope="module")
def llm(bench_checkpoint, bench_dtype):
    llm = LLM(model=str(bench_checkpoint), dtype=bench_dtype, max_concurrency=max(BATCHES),
              max_model_len=MAX_MODEL_LEN, kv_pool_tokens=max(BATCHES) * (CONTEXT + 64), threads=0)
    yield llm
    llm.close()
    del llm
    gc.collect()


@pytest.mark.parametrize("batch", BATCHES)
def test_decode_pagedserve(benchmark, llm, machine, bench_report, batch):
    benchmark.group = f"decode b={batch}"
    step = time_decode(benchmark, llm.engine.loop, batch, CONTEXT, MAX_MODEL_LEN, OUR_STEPS)
    steps = OUR_STEPS + 2       # the K/V read grows by one token a step
    tok_s = batch / step.median
    model, pool = llm.engine.model, llm.engine.pool
    kv_bytes = batch * (CONTEXT + steps) * pool.shape.bytes_per_block // pool.shape.block_size
    roof = machine.decode_tok_s(weight_bytes=model.weight_bytes, batch=batch, kv_bytes=kv_bytes)
    benchmark.extra_info.update(tok_s=tok_s, step_ms_median=step.median * 1e3, roofline_tok_s=roof)
    group = f"decode b={batch}"
    bench_report.add(group, "pagedserve", tok_s, "tok/s", subject=True,
                     note=f"median of {OUR_STEPS} steps, context ~{CONTEXT}, "
                          f"{step.median * 1e3:.1f} ms/step")
    bench_report.add(group, "roofline", roof, "tok/s",
                     note=f"{model.weight_bytes / 1e9:.2f} GB weights + K/V per step")
    flops = decoder_flops(model.cfg, tokens=batch, attended=batch * (CONTEXT + steps), logit_rows=batch)
    bench_report.add(group, "GEMM ceiling", machine.gemm_tok_s(flops=flops, tokens=batch), "tok/s",
                     note=f"{flops / 1e9:.1f} GFLOP per step at the probe's rate; "
                          f"ours ran {flops / step.median / 1e9:.0f} GFLOP/s")


@pytest.mark.parametrize("batch", HF_BATCHES)
def test_decode_transformers(benchmark, hf_model, bench_report, batch):
    """Per-step time = (generate 1 + HF_STEPS tokens - generate 1 token) / HF_STEPS: the prefill
    and the first token cancel out."""
    prompts = random_prompts(batch, CONTEXT, seed=batch)
    prefill_s = statistics.median(hf_generate_s(hf_model, prompts, 1) for _ in range(HF_ROUNDS))
    full = Timed(hf_generate_s)
    benchmark.group = f"decode b={batch}"
    benchmark.pedantic(full, args=(hf_model, prompts, HF_STEPS + 1), rounds=HF_ROUNDS, iterations=1)
    step_s = (full.median - prefill_s) / HF_STEPS
    assert step_s > 0, f"generate of {HF_STEPS + 1} tokens was not slower than of 1 token"
    benchmark.extra_info.update(tok_s=batch / step_s, step_ms=step_s * 1e3)
    bench_report.add(f"decode b={batch}", "transformers", batch / step_s, "tok/s",
                     note=f"generate, {HF_ROUNDS} rounds, {step_s * 1e3:.1f} ms/step")
