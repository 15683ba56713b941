"""Decode time per token against context length (256 -> 4,096) for a Qwen3.5-shaped hybrid model (bf16):
the Gated DeltaNet layers keep a fixed-size state, so their share must stay flat while the full-attention
layers grow with the context.

    .venv/bin/python -m pytest bench/test_hybrid_context.py -q -s -p no:cacheprovider
    .venv/bin/python bench/test_hybrid_context.py            # the same table, without the bench fixtures

The model is random (hidden 1024, 8 layers with 3 linear-attention layers per full-attention layer, Qwen3.5's
linear/attention head shapes), built once with transformers and cached on disk.
"""
from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

CONTEXTS = (256, 512, 1024, 2048, 4096)
DECODE_STEPS = 8                 # timed decode steps per context (after 2 warm-up steps)
CACHE = Path.home() / ".cache" / "pagedserve" / "bench" / "qwen3_5-h1024-l8-3to1"
SHAPE = dict(arch="qwen3_5", hidden=1024, layer_types=(("linear_attention",) * 3 + ("full_attention",)) * 2,
             heads=8, kv_heads=2, head_dim=256, linear_heads=(16, 16), linear_dims=(128, 128),
             intermediate=3584, max_pos=8192)


def _checkpoint() -> Path:
    if (CACHE / "config.json").is_file():
        return CACHE
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from tiny_models import make_hybrid_checkpoint

    return make_hybrid_checkpoint(CACHE, **SHAPE)


class _MixerClock:
    """Wall time spent in each token-mixer class while installed (decode steps only are measured)."""

    def __init__(self):
        from engine.models.gated_attention import GatedAttention
        from engine.models.gated_deltanet import GatedDeltaNet

        self.classes = {"linear attention": GatedDeltaNet, "full attention": GatedAttention}
        self.spent = dict.fromkeys(self.classes, 0.0)
        self._saved = {}

    def __enter__(self):
        for name, cls in self.classes.items():
            call = cls.__call__
            self._saved[name] = call

            def timed(obj, *args, _call=call, _name=name):
                t0 = time.perf_counter()
                out = _call(obj, *args)
                self.spent[_name] += time.perf_counter() - t0
                return out

            cls.__call__ = timed
        return self

    def __exit__(self, *exc):
        for name, cls in self.classes.items():
            cls.__call__ = self._saved[name]


def measure(progress=lambda row: None) -> list[dict]:
    import torch

    from engine import LLM, SamplingParams

    llm = LLM(model=str(_checkpoint()), dtype="auto", max_concurrency=1,
              max_model_len=max(CONTEXTS) + 64, kv_pool_tokens=max(CONTEXTS) + 128)
    loop, rows = llm.engine.loop, []
    gen = torch.Generator().manual_seed(0)
    for context in CONTEXTS:
        prompt = torch.randint(0, 400, (context,), generator=gen).tolist()
        handle = loop.submit(prompt, SamplingParams(temperature=0, max_tokens=DECODE_STEPS + 4, ignore_eos=True),
                             bounded=False)
        while not any(r.generated_tokens for r in loop.scheduler.stats().requests):
            loop.run_once()                      # prefill, until the first token
        for _ in range(2):
            loop.run_once()
        steps, mixers = [], []
        for _ in range(DECODE_STEPS):
            with _MixerClock() as clock:
                t0 = time.perf_counter()
                loop.run_once()
                steps.append(time.perf_counter() - t0)
            mixers.append(clock.spent)
        handle.cancel()
        loop.run_until_idle()
        rows.append(dict(context=context, step_ms=statistics.median(steps) * 1e3,
                         **{f"{k}_ms": statistics.median(m[k] for m in mixers) * 1e3 for k in mixers[0]}))
        progress(rows[-1])
    llm.close()
    return rows


HEADER = "context  decode ms/token  linear-attn ms (6 layers)  full-attn ms (2 layers)"


def line(r: dict) -> str:
    return (f"{r['context']:>7}  {r['step_ms']:>15.1f}  {r['linear attention_ms']:>25.2f}  "
            f"{r['full attention_ms']:>23.2f}")


def table(rows: list[dict]) -> str:
    return "\n".join([HEADER, *map(line, rows)])


def test_hybrid_decode_time_against_context(bench_report):
    rows = measure()
    print("\n" + table(rows))
    for r in rows:
        bench_report.add("hybrid decode", f"context {r['context']}", r["step_ms"], "ms/token",
                         note=f"linear attn {r['linear attention_ms']:.2f} ms, "
                              f"full attn {r['full attention_ms']:.2f} ms")
    first, last = rows[0], rows[-1]
    # the linear layers' cost does not depend on the context (generous bound: the machines are noisy)
    assert last["linear attention_ms"] < 2.0 * first["linear attention_ms"] + 1.0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    print(HEADER, flush=True)
    measure(lambda row: print(line(row), flush=True))
