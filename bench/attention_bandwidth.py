"""Decode attention against the memory roofline: bytes of K/V one `paged_attention` decode call reads, over
its time, next to the machine's read bandwidth measured in the same process.

Default-model shapes (Qwen2.5-1.5B: 12 query heads, 2 kv heads, head_dim 128, blocks of 16), one new token
per row. Each case cycles over enough layers' caches that their K/V cannot stay in the last-level cache,
allocated as the engine's pool allocates them, with shuffled block tables (a pool after some churn). Two
probes: bench/roofline.py's (a 256 MiB copy and sum, at the start) and a sum over the same K/V bytes,
timed between the kernel calls; the table gives a kernel's rate as a share of each ("of roofline" is the
machine's bandwidth: a case's own probe is two torch calls, and over one row's few MiB their overheads keep
it well below that). With `--baseline REV` the C++ kernel of that git revision is built into a
scratch extension and timed alternately with this checkout's, call by call, each call on a layer the
previous calls did not read (a revision from before quantized caches were kept in tiles gets the same
values in its own row order). `--hot` keeps one layer instead (16 calls a round), so a context whose K/V fit
the caches times the kernel's arithmetic without the memory: the floor below which no prefetching can bring
it. `--reads` adds bench/kv_reads.cpp's reads of the same bytes with no arithmetic, block by block in memory
order with prefetching ("reads"): the most a kernel reading the cache could reach. `--reads-work N ...` adds
those reads with N fp32 multiply-adds (16 lanes) on the data per 64-byte line pair ("reads+N"): with `--hot`
that arithmetic alone, without it how much of it the machine hides under the reads (a kernel's arithmetic
is hidden only as far as this synthetic one is). The machines are shared: compare kernels within one run, and
rerun when the probe reads low.

    .venv/bin/python bench/attention_bandwidth.py --baseline HEAD
    .venv/bin/python bench/attention_bandwidth.py --rows 1 --q-dtypes float32 --kv-dtypes bfloat16 float16
    .venv/bin/python bench/attention_bandwidth.py --rows 1 32 --kv-dtypes bfloat16 q8_0 q4_0
    .venv/bin/python bench/attention_bandwidth.py --rows 1 --contexts 2048 --kv-dtypes q8_0 --hot
    .venv/bin/python bench/attention_bandwidth.py --rows 1 --q-dtypes bfloat16 --kv-dtypes q8_0 --reads
    .venv/bin/python bench/attention_bandwidth.py --rows 1 --q-dtypes bfloat16 --kv-dtypes q8_0 --reads-work 4 8 16
    .venv/bin/python bench/attention_bandwidth.py --rows 1 --q-dtypes float32 --kv-dtypes q4_0 --lanes 8 --baseline HEAD
"""
from __future__ import annotations

import argparse
import functools
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent))
Q_HEADS, KV_HEADS, HEAD_DIM, BLOCK = 12, 2, 128, 16
COLD_BYTES = 256 << 20          # K/V cycled through per case: several times a last-level cache


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 32])
    p.add_argument("--contexts", type=int, nargs="+", default=[8192])
    p.add_argument("--q-dtypes", nargs="+", default=["bfloat16", "float32"], help="activation dtypes")
    p.add_argument("--kv-dtypes", nargs="+", default=["bfloat16", "float16", "float32", "q8_0", "q4_0"],
                   help="torch dtypes, or the quantized formats q8_0 / q4_0")
    p.add_argument("--q-heads", type=int, default=Q_HEADS, help="query heads (GQA group = q heads / 2 kv heads)")
    p.add_argument("--rounds", type=int, default=4, help="passes over a case's layers per kernel")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--lanes", type=int, default=0,
                   help="cap the kernels' vector width (8: the AVX2 set's kernels on an AVX-512 CPU)")
    p.add_argument("--baseline", default="", help="a git revision whose paged_attention.cpp runs alternately")
    p.add_argument("--hot", action="store_true",
                   help="one layer, read again by every call: with K/V in cache, what the kernel's arithmetic costs")
    p.add_argument("--reads", action="store_true",
                   help="also time the reads alone, with no arithmetic (bench/kv_reads.cpp)")
    p.add_argument("--reads-work", type=int, nargs="+", default=[],
                   help="also time the reads with this many multiply-adds per 64-byte line pair, each")
    return p.parse_args(argv)


def reads_rows(ref: str) -> bool:
    """Whether git revision `ref` keeps quantized caches in (slot, kv head) rows rather than in tiles."""
    text = subprocess.run(["git", "show", f"{ref}:ops/kv_quant.py"], cwd=BENCH.parent, check=True,
                          capture_output=True, text=True).stdout
    return "def arrange(" not in text


def build_baseline(ref: str):
    """The decode kernel of git revision `ref`, under the op namespace `pagedserve_baseline` (the
    checkout's own extension already holds `pagedserve_cpu`)."""
    from torch.utils import cpp_extension

    from ops.cpu import build

    repo = BENCH.parent
    commit = subprocess.run(["git", "rev-parse", ref], cwd=repo, check=True, capture_output=True,
                            text=True).stdout.strip()
    root = Path(tempfile.gettempdir()) / f"pagedserve-baseline-{commit[:12]}"   # reused by later runs
    root.mkdir(exist_ok=True)
    names = subprocess.run(["git", "ls-tree", "--name-only", commit, "ops/cpu/"], cwd=repo, check=True,
                           capture_output=True, text=True).stdout.split()
    for name in [n for n in names if n.endswith(".h")] + ["ops/cpu/paged_attention.cpp"]:
        text = subprocess.run(["git", "show", f"{commit}:{name}"], cwd=repo, check=True, capture_output=True,
                              text=True).stdout
        (root / Path(name).name).write_text(text.replace("TORCH_LIBRARY_FRAGMENT(pagedserve_cpu",
                                                         "TORCH_LIBRARY_FRAGMENT(pagedserve_baseline"))
    cpp_extension.load(name="pagedserve_baseline", sources=[str(root / "paged_attention.cpp")],
                       extra_cflags=build.CFLAGS, extra_ldflags=build.LDFLAGS, build_directory=str(root),
                       is_python_module=False, verbose=False)
    return torch.ops.pagedserve_baseline.paged_attention_decode


def build_reads(works: list[int]) -> dict:
    """bench/kv_reads.cpp's op, which reads what a decode call reads, called like the kernels: with no
    arithmetic ("reads"), and with each of `works` multiply-adds per line pair."""
    from torch.utils import cpp_extension

    from ops.cpu import build

    root = Path(tempfile.gettempdir()) / "pagedserve-bench-reads"
    root.mkdir(exist_ok=True)
    cpp_extension.load(name="pagedserve_bench_reads", sources=[str(BENCH / "kv_reads.cpp")],
                       extra_cflags=build.CFLAGS, extra_ldflags=build.LDFLAGS, build_directory=str(root),
                       is_python_module=False, verbose=False)
    reads = torch.ops.pagedserve_bench.paged_reads
    return {f"reads+{w}" if w else "reads": functools.partial(reads, work=w) for w in works}


def random_rows(dims: tuple[int, ...], fmt: str, g: torch.Generator) -> torch.Tensor:
    """Quantized rows of random values and scales, without quantizing gigabytes of floats."""
    from ops import kv_quant

    rows = torch.randint(0, 256, dims, generator=g, dtype=torch.uint8)
    blocks = rows.view(*dims[:-1], -1, kv_quant.BLOCK_BYTES[fmt])
    blocks[..., :2] = (torch.rand(blocks.shape[:-1], generator=g) / 64).half().view(torch.uint8).view(
        *blocks.shape[:-1], 2)
    return rows


def make_case(rows: int, context: int, q_dtype: torch.dtype, kv_dtype: torch.dtype | str, seed: int = 0,
              q_heads: int = Q_HEADS, hot: bool = False, row_order: bool = False):
    """Per layer: q [rows, Hq, D] and shuffled-table caches; one decode token per row. `kv_dtype` is a
    storage dtype or a quantized format's name. `hot`: a single layer. `row_order`: each case also holds
    its quantized caches in row order (for an older kernel), as a second tuple (else None)."""
    from engine.kv.pool import KVShape, lazy_zeros
    from ops import kv_quant

    g = torch.Generator().manual_seed(seed)
    per_row = -(-context // BLOCK)
    shape = KVShape(1, KV_HEADS, HEAD_DIM, BLOCK, kv_dtype)
    dims = (rows * per_row, BLOCK, *shape.slot_dims)
    layer_bytes = rows * per_row * shape.bytes_per_block
    cases = []
    quantized = isinstance(kv_dtype, str)
    for _ in range(1 if hot else max(4, -(-COLD_BYTES // layer_bytes))):
        caches, in_rows = [], []
        for role in kv_quant.ROLES:
            cache = lazy_zeros(dims, shape.storage_dtype, torch.device("cpu"))
            if quantized:
                values = random_rows(dims, kv_dtype, g)
                cache.copy_(kv_quant.arrange(values, kv_dtype, role))
                if row_order:
                    in_rows.append(lazy_zeros(dims, shape.storage_dtype, torch.device("cpu")).copy_(values))
            else:
                cache.copy_(torch.randn(dims, generator=g))
            caches.append(cache)
        tables = torch.randperm(dims[0], generator=g).view(rows, per_row).int()
        q = torch.randn(rows, q_heads, HEAD_DIM, generator=g).to(q_dtype)
        rest = (torch.arange(rows + 1, dtype=torch.int32), torch.full((rows,), context, dtype=torch.int32), tables)
        cases.append(((q, *caches, *rest), (q, *in_rows, *rest) if in_rows else None))
    return cases, layer_bytes


def measure(kernels: dict, cases: list, rounds: int, in_rows: set) -> dict[str, list[float]]:
    """Seconds per call of each kernel and of the read probe, taking turns; every call reads the next layer
    of the rotation, so none finds its K/V left in the cache by the call before. The kernels named in
    `in_rows` read the cases' row-order caches where they have them."""
    probes = [(k.view(-1).view(torch.float32), v.view(-1).view(torch.float32)) for (_, k, v, *_), _ in cases]

    def args(name, case):
        return case[1] if name in in_rows and case[1] else case[0]
    times = {name: [] for name in [*kernels, "read probe"]}
    for name, fn in kernels.items():         # warm-up: one pass over the layers
        for case in cases:
            fn(*args(name, case), HEAD_DIM ** -0.5)
    turn = 0
    for r in range(rounds * len(cases)):
        # the kernels take turns in the opposite order every other pass: the one that always followed the
        # probe timed slower than the same code after another kernel
        order = [*kernels] if r % 2 == 0 else [*reversed(kernels)]
        for name in [*order, "read probe"]:
            i, turn = turn % len(cases), turn + 1
            t0 = time.perf_counter()
            if name == "read probe":
                probes[i][0].sum()
                probes[i][1].sum()
            else:
                kernels[name](*args(name, cases[i]), HEAD_DIM ** -0.5)
            times[name].append(time.perf_counter() - t0)
    return times


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    from roofline import measure_bandwidth_gb_s

    import ops.cpu
    if not ops.cpu.kernels_available():
        raise SystemExit("the C++ CPU kernels did not load (see the log line above)")
    # both raw: no Python checks in the timing
    kernels = {"new": functools.partial(ops.cpu._lib.paged_attention_decode, lanes=args.lanes)}
    in_rows = set()
    if args.baseline:
        kernels[f"old ({args.baseline})"] = functools.partial(build_baseline(args.baseline), lanes=args.lanes)
        if reads_rows(args.baseline):
            in_rows.add(f"old ({args.baseline})")
    if args.reads or args.reads_work:
        kernels.update(build_reads(([0] if args.reads else []) + args.reads_work))
    bandwidth = measure_bandwidth_gb_s()
    print(f"probe (bench/roofline.py) {bandwidth:.1f} GB/s, {args.threads} threads, CPU capability "
          f"{torch.backends.cpu.get_cpu_capability()}; medians, and % of the read probe of the same case "
          f"and of bench/roofline.py's probe")
    print(f"{'rows':>5} {'ctx':>6} {'q':>9} {'kv':>9} {'kernel':>12} {'ms':>8} {'GB/s':>7} {'of probe':>9} "
          f"{'of roofline':>12}")
    with torch.inference_mode():
        for rows in args.rows:
            for context in args.contexts:
                for q_name in args.q_dtypes:
                    for kv_name in args.kv_dtypes:
                        q_dtype = getattr(torch, q_name)
                        kv_dtype = kv_name if kv_name in ("q8_0", "q4_0") else getattr(torch, kv_name)
                        cases, nbytes = make_case(rows, context, q_dtype, kv_dtype, q_heads=args.q_heads,
                                                  hot=args.hot, row_order=bool(in_rows))
                        times = measure(kernels, cases, args.rounds * (16 if args.hot else 1), in_rows)
                        probe = statistics.median(times["read probe"])
                        for name, ts in times.items():
                            s = statistics.median(ts)
                            print(f"{rows:>5} {context:>6} {q_name:>9} {kv_name:>9} {name:>12} {s * 1e3:>8.3f} "
                                  f"{nbytes / s / 1e9:>7.1f} {probe / s:>9.0%} {nbytes / s / 1e9 / bandwidth:>12.0%}")
                        del cases


if __name__ == "__main__":
    main(sys.argv[1:])
