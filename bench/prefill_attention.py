"""One layer's attention of a prefill chunk after a cached prefix, by each route `paged_attention` has on
this CPU: the C++ kernel (every token reading the prefix in turn, a few tokens per K/V read), torch's
flash SDPA on the prefix gathered and widened or dequantized (`ops.paged_attention._prefill_row`, with the
C++ gather) and, for a bf16 cache where the CPU has AVX-512 BF16, prefill_attention.cpp (16 tokens a
vector), calls alternated, medians. Default-model shapes (12 query heads, 2 kv heads, head_dim 128,
blocks of 16, shuffled block tables), bf16 queries. What `ops.cpu` sends where (QUANT_SDPA_TOKENS,
SAME_DTYPE_ROW_TOKENS, LANES_ROW_TOKENS) comes from tables like this one.

    .venv/bin/python bench/prefill_attention.py --kv-dtypes q8_0 q4_0 --chunks 128 256 512 --prefixes 2048 8192 27648
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent))
sys.path.insert(0, str(BENCH))
Q_HEADS, KV_HEADS, HEAD_DIM, BLOCK, SCALE = 12, 2, 128, 16, 128 ** -0.5


def case(kv_dtype: str, prefix: int, chunk: int, g: torch.Generator):
    """q [chunk, Hq, D] bf16 and one row's caches of prefix + chunk positions (random quantized rows or bf16)."""
    from attention_bandwidth import random_rows
    from engine.kv.pool import KVShape, lazy_zeros
    from ops import kv_quant

    ctx = prefix + chunk
    blocks = -(-ctx // BLOCK)
    shape = KVShape(1, KV_HEADS, HEAD_DIM, BLOCK, torch.bfloat16 if kv_dtype == "bf16" else kv_dtype)
    dims = (blocks, BLOCK, *shape.slot_dims)
    caches = []
    for role in kv_quant.ROLES:
        cache = lazy_zeros(dims, shape.storage_dtype, torch.device("cpu"))
        cache.copy_(torch.randn(dims, generator=g) if kv_dtype == "bf16"
                    else kv_quant.arrange(random_rows(dims, kv_dtype, g), kv_dtype, role))
        caches.append(cache)
    q = torch.randn(chunk, Q_HEADS, HEAD_DIM, generator=g).bfloat16()
    return q, caches, torch.randperm(blocks, generator=g).int()[None], ctx


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kv-dtypes", nargs="+", default=["q8_0", "q4_0", "bf16"], choices=["q8_0", "q4_0", "bf16"])
    p.add_argument("--chunks", type=int, nargs="+", default=[128, 256, 512], help="new tokens of the row")
    p.add_argument("--prefixes", type=int, nargs="+", default=[2048, 4096, 8192, 16384], help="cached tokens")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)

    import ops.cpu
    from ops.paged_attention import _prefill_row

    if not ops.cpu.install():
        sys.exit("the C++ kernels did not build: nothing to compare")
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    print(f"instruction sets: {','.join(sorted(ops.cpu.INSTRUCTION_SETS))}")
    for kv_dtype in args.kv_dtypes:
        for prefix in args.prefixes:
            for chunk in args.chunks:
                q, (kc, vc), table, ctx = case(kv_dtype, prefix, chunk, g)
                qsl, lens = torch.tensor([0, chunk], dtype=torch.int32), torch.tensor([ctx], dtype=torch.int32)

                def kernel():
                    return ops.cpu._lib.paged_attention_decode(q, kc, vc, qsl, lens, table, SCALE, 0, 0, 2**31 - 1)[0]

                def sdpa():
                    out = torch.zeros_like(q)
                    _prefill_row(out, q, kc, vc, 0, chunk, ctx, table[0], SCALE, ops.cpu.cpp_gather_kv)
                    return out

                def lanes():
                    return ops.cpu._lib.prefill_attention(q, kc, vc, table[0], ctx, SCALE)

                routes = {"kernel": kernel, "sdpa": sdpa}
                if kv_dtype == "bf16" and "avx512_bf16" in ops.cpu.INSTRUCTION_SETS:
                    routes["lanes"] = lanes
                times = {name: [] for name in routes}
                for _ in range(args.rounds):
                    for name, fn in routes.items():
                        start = time.perf_counter()
                        fn()
                        times[name].append(time.perf_counter() - start)
                ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
                print(f"{kv_dtype:5s} {chunk:4d} tokens after {prefix:6,d}: "
                      + ", ".join(f"{name} {t:7.1f} ms" for name, t in ms.items())
                      + f" (kernel / sdpa {ms['kernel'] / ms['sdpa']:.2f}x"
                      + (f", kernel / lanes {ms['kernel'] / ms['lanes']:.2f}x)" if "lanes" in ms else ")"), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
