"""The cost of constrained decoding: decode steps whose rows all follow a JSON schema next to the same
steps unconstrained, alternated in one run (the default Q4_K_M model when pulled, else the bench
model), and the compile time of a 50-property schema."""
from __future__ import annotations

import gc
import statistics
import time

import pytest

from decode_steps import Repeat, time_decode
from engine import LLM, SamplingParams
from engine.grammar import Grammar, GrammarCompiler

DEFAULT_PRESET = "qwen2.5-coder-1.5b"
BATCHES = (1, 8)
CONTEXT = 128
STEPS = 10
ROUNDS = 3                  # plain and constrained alternate this many times; medians over all steps
MAX_MODEL_LEN = 512
# an array of at least 200 numbers: no row can finish within the timed steps
LONG_JSON = Grammar.json_schema({"type": "array", "items": {"type": "integer"}, "minItems": 200})


@pytest.fixture(scope="module")
def llm(bench_checkpoint, bench_dtype):
    from engine.loading.presets import pulled_path
    spec = DEFAULT_PRESET if pulled_path(DEFAULT_PRESET) is not None else str(bench_checkpoint)
    # speculative off: unconstrained rows would get proposals that constrained ones never get
    llm = LLM(model=spec, dtype=bench_dtype, max_concurrency=max(BATCHES), max_model_len=MAX_MODEL_LEN,
              kv_pool_tokens=max(BATCHES) * MAX_MODEL_LEN, speculative="none")
    yield spec, llm
    llm.close()
    del llm
    gc.collect()


@pytest.mark.parametrize("batch", BATCHES)
def test_constrained_decode(llm, bench_report, batch):
    spec, llm = llm
    constrained = SamplingParams(temperature=0, max_tokens=MAX_MODEL_LEN, grammar=LONG_JSON)
    times: dict[str, list[float]] = {"unconstrained": [], "json schema": []}
    for _ in range(ROUNDS):
        for name, params in (("unconstrained", None), ("json schema", constrained)):
            step = time_decode(Repeat, llm.engine.loop, batch, CONTEXT, MAX_MODEL_LEN, STEPS,
                               params=params)
            times[name] += step.times
    for name, values in times.items():
        median = statistics.median(values)
        bench_report.add(f"structured decode b={batch}", name, batch / median, "tok/s",
                         subject=name == "json schema",
                         note=f"{spec}; median of {len(values)} steps, {median * 1e3:.1f} ms/step, "
                              f"{ROUNDS} alternated rounds")


def test_schema_compile_time(llm, bench_report):
    _, llm = llm
    t0 = time.perf_counter()        # what the engine does once while it loads
    grammars = GrammarCompiler(llm.tokenizer.to_json(), llm.engine.model_config.vocab_size,
                               llm.engine.loop.eos_token_ids)
    tokenizer_s = time.perf_counter() - t0
    times = []
    for trial in range(5):      # a new schema each time: nothing comes from the cache
        schema = {"type": "object", "additionalProperties": False, "required": [f"p{i}" for i in range(50)],
                  "properties": {f"p{i}_{trial}" if i == 0 else f"p{i}": {"type": ["string", "integer", "boolean"][i % 3]}
                                 for i in range(50)}}
        schema["required"][0] = f"p0_{trial}"
        t0 = time.perf_counter()
        grammars.compile(Grammar.json_schema(schema))
        times.append(time.perf_counter() - t0)
    bench_report.add("grammar compile", "50-property schema", statistics.median(times) * 1e3, "ms",
                     subject=True, note=f"median of 5; building the compiler (at engine load) took {tokenizer_s:.2f} s")
