"""Decode with quantized weights next to our own dense path in the same run: the default model
(Qwen2.5-Coder-1.5B-Instruct Q4_K_M, kept quantized vs widened to the engine dtype) and the bench's
random model quantized at load to int4 and int8. The dense rows are the regression baseline."""
from __future__ import annotations

import gc

import pytest

from decode_steps import time_decode
from engine import LLM

DEFAULT_PRESET = "qwen2.5-coder-1.5b"
BATCHES = (1, 8)
CONTEXT = 128
STEPS = 10
MAX_MODEL_LEN = 512
# (model, quantization): "bench" is the --bench-model random checkpoint. The widened default model (7 GB
# fp32) goes last: run after it, the bench model's int4 steps took 69 instead of 24-33 ms (same tree).
CASES = (("bench", "int4"), ("bench", "int8"), ("bench", "none"), (DEFAULT_PRESET, "auto"), (DEFAULT_PRESET, "none"))
SUBJECTS = {DEFAULT_PRESET: ("auto",), "bench": ("int4", "int8")}


@pytest.fixture(scope="module", params=CASES, ids=lambda c: f"{c[0]}-{c[1]}")
def case_llm(request, bench_checkpoint, bench_dtype):
    model, quantization = request.param
    if model == DEFAULT_PRESET:
        from engine.loading.presets import pulled_path
        if pulled_path(DEFAULT_PRESET) is None:
            pytest.skip(f"preset {DEFAULT_PRESET} is not downloaded: run `pagedserve pull {DEFAULT_PRESET}`")
    spec = str(bench_checkpoint) if model == "bench" else model
    llm = LLM(model=spec, dtype=bench_dtype, quantization=quantization, max_concurrency=max(BATCHES),
              max_model_len=MAX_MODEL_LEN, kv_pool_tokens=max(BATCHES) * MAX_MODEL_LEN, threads=0, speculative="none")
    yield model, quantization, llm
    llm.close()
    del llm
    gc.collect()


@pytest.mark.parametrize("batch", BATCHES)
def test_quantized_decode(benchmark, case_llm, bench_report, pytestconfig, batch):
    model, quantization, llm = case_llm
    label = pytestconfig.getoption("--bench-model") if model == "bench" else model
    benchmark.group = f"{label} {quantization} decode b={batch}"
    step = time_decode(benchmark, llm.engine.loop, batch, CONTEXT, MAX_MODEL_LEN, STEPS)
    tok_s = batch / step.median
    weights = llm.engine.model.weight_bytes
    benchmark.extra_info.update(tok_s=tok_s, step_ms_median=step.median * 1e3, weight_bytes=weights)
    note = (f"{llm.engine.weights}; {weights / 1e9:.2f} GB weights, median of {STEPS} steps, "
            f"{step.median * 1e3:.1f} ms/step")
    # each subject's group holds the dense run of the same model as its baseline
    for subject in SUBJECTS[model]:
        if quantization in (subject, "none"):
            bench_report.add(f"{label} {subject} vs dense, decode b={batch}", f"quantization {quantization}",
                             tok_s, "tok/s", subject=quantization == subject, note=note)
