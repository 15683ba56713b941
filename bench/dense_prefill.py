"""quant_linear's dense path for prefill chunks (CPUs with AMX-BF16: the weights dequantized to bf16 and
torch's GEMM) against the integer kernels, in one process, switched by `ops.cpu.DENSE_ROWS`: the time to the
first token of fresh prompts (the two paths alternated, medians), and the per-token log-likelihood
(perplexity) of a fixed text, teacher-forced in 512-token chunks, under each.

    .venv/bin/python bench/dense_prefill.py --contexts 512 2048 8192 --rounds 3
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
import textwrap
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent))
sys.path.insert(0, str(BENCH))

import ops.cpu  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402
from kv_cache_dtypes import token_logprobs  # noqa: E402

NEVER = 2**31 - 1


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen2.5-coder-1.5b")
    p.add_argument("--contexts", type=int, nargs="+", default=[512, 2048, 8192])
    p.add_argument("--rounds", type=int, default=3, help="fresh prompts per context and path")
    p.add_argument("--text-tokens", type=int, default=2000)
    args = p.parse_args(argv)
    dense_rows = ops.cpu.DENSE_ROWS
    if dense_rows == NEVER:
        sys.exit("these kernels have no dense path (it needs a CPU with AMX-BF16 and kernels built for it)")
    paths = {"integer": NEVER, "dense": dense_rows}
    longest = max(args.contexts)
    llm = LLM(model=args.model, max_model_len=longest + 64, kv_pool_tokens=longest + 256)
    print(f"{args.model}: activations {llm.engine.dtype}, dense path from {dense_rows} rows")
    llm.generate([[101, 102, 103] * 60], SamplingParams(max_tokens=2))      # warm-up, both paths
    took = {(ctx, path): [] for ctx in sorted(args.contexts) for path in paths}
    for r in range(args.rounds):
        for ctx in sorted(args.contexts):
            for i, (path, rows) in enumerate(paths.items()):
                ops.cpu.DENSE_ROWS = rows
                prompt = [(j * 7919 + 31 * (2 * r + i + 1) + ctx) % 30000 + 100 for j in range(ctx)]
                start = time.perf_counter()
                llm.generate([prompt], SamplingParams(max_tokens=1))
                took[ctx, path].append(time.perf_counter() - start)
    for ctx in sorted(args.contexts):
        med = {path: statistics.median(took[ctx, path]) for path in paths}
        print(f"{ctx:6,} fresh tokens to the first token: integer {med['integer']:.2f} s "
              f"({ctx / med['integer']:.0f} tok/s), dense {med['dense']:.2f} s ({ctx / med['dense']:.0f} tok/s), "
              f"dense/integer {med['dense'] / med['integer']:.2f}", flush=True)
    ids = llm.tokenizer.encode(Path(textwrap.__file__).read_text())[:args.text_tokens]
    logps = {}
    for path, rows in paths.items():
        ops.cpu.DENSE_ROWS = rows
        logps[path] = token_logprobs(llm.engine, ids)
    for path, lp in logps.items():
        print(f"{path}: perplexity {math.exp(-sum(lp) / len(lp)):.4f} over {len(lp)} tokens")
    delta = [abs(a - b) for a, b in zip(logps["integer"], logps["dense"])]
    print(f"per-token log-likelihood change: mean {statistics.mean(delta):.4f}, largest {max(delta):.4f}")
    ops.cpu.DENSE_ROWS = dense_rows


if __name__ == "__main__":
    main(sys.argv[1:])
