"""Speculation on a random Qwen3.5-shaped hybrid model (Gated DeltaNet + attention, fp32) whose greedy
output repeats itself (tied embeddings scaled up, as in the tests), on repetitive id prompts: plain
decoding against n-gram proposals and against the model as its own draft, tok/s, rounds alternated,
medians, greedy outputs compared. A self-draft costs a target forward per proposal, so it shows the
bookkeeping's cost (every proposal is accepted), not a speed-up.

    .venv/bin/python bench/hybrid_speculation.py --size medium --embed-scale 80 --streams 1 4
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent))
sys.path.insert(0, str(BENCH.parent / "tests"))

from engine import LLM, SamplingParams  # noqa: E402
from tiny_models import make_hybrid_checkpoint  # noqa: E402

SHAPES = {"tiny": {}, "medium": dict(
    hidden=512, layer_types=("linear_attention",) * 3 + ("full_attention",) + ("linear_attention",) * 3
    + ("full_attention",), heads=8, kv_heads=2, head_dim=64, linear_heads=(4, 8), linear_dims=(64, 64),
    intermediate=1536)}
PROMPTS = [[3, 4] * 15, [7, 8, 9, 10, 11] * 6, list(range(30, 50)) * 3, [100, 101, 102] * 10]


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", choices=sorted(SHAPES), default="medium")
    p.add_argument("--embed-scale", type=float, default=80.0)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--streams", type=int, nargs="+", default=[1, 4])
    p.add_argument("--methods", nargs="+", choices=["ngram", "draft"], default=["ngram", "draft"])
    args = p.parse_args(argv)
    path = str(make_hybrid_checkpoint(tempfile.mkdtemp(), "qwen3_5", tied=True, embed_scale=args.embed_scale,
                                      max_pos=2048, **SHAPES[args.size]))
    common = dict(model=path, dtype="float32", kv_pool_tokens=8192, max_model_len=512,
                  max_concurrency=max(args.streams))
    # the self-draft as the target loads it (not int4): its proposals are the target's own draws
    extra = {"ngram": dict(speculative="ngram"), "draft": dict(draft_model=path, draft_quantization="none")}
    engines = {"none": LLM(**common), **{m: LLM(**common, **extra[m]) for m in args.methods}}
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    for streams in args.streams:
        prompts = [PROMPTS[i % len(PROMPTS)] for i in range(streams)]
        for llm in engines.values():
            llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))     # warm-up
        times, outs = {m: [] for m in engines}, {}
        before = {m: llm.engine.scheduler.stats() for m, llm in engines.items()}
        for _ in range(args.rounds):
            for mode, llm in engines.items():
                start = time.perf_counter()
                outs[mode] = [o.token_ids for o in llm.generate(prompts, params)]
                times[mode].append(time.perf_counter() - start)
        tok = streams * args.tokens
        line = f"{args.size} x{streams}: none {tok / statistics.median(times['none']):.1f} tok/s"
        for mode in args.methods:
            after = engines[mode].engine.scheduler.stats()
            ratios = [a / b for a, b in zip(times["none"], times[mode])]
            line += (f"; {mode} {tok / statistics.median(times[mode]):.1f} tok/s, speed-up median "
                     f"{statistics.median(ratios):.2f} (rounds {', '.join(f'{r:.2f}' for r in ratios)}), accepted "
                     f"{after.spec_accepted_tokens_total - before[mode].spec_accepted_tokens_total}/"
                     f"{after.spec_proposed_tokens_total - before[mode].spec_proposed_tokens_total}, "
                     f"same greedy: {outs['none'] == outs[mode]}")
        print(line, flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
