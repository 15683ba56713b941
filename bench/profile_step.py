"""Where one engine step spends its time: decode steps at several batch sizes and one prefill chunk,
with the torch op bodies and with the C++ CPU kernels (ops.cpu), in the same run.

    python bench/profile_step.py [--model 0.6b|mini|SPEC] [--quantization auto|none|int8|int4]
                                 [--batch 1 8 32] [--prefill 512] [--backend both]

Each case is stepped through the real scheduler + runner (`EngineLoop.run_once`): first unprofiled
(median wall time per step), then under torch.profiler for the breakdown. Profiled op times are
inflated by the profiler's own cost per op; the "step wall" column is the unprofiled median.
"""
from __future__ import annotations

import argparse
import gc
import itertools
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR.parent))
sys.path.insert(0, str(BENCH_DIR))

import engine.runner  # noqa: E402
import ops.cpu  # noqa: E402
from decode_steps import generated, prefill_once, prime_decoders  # noqa: E402
from engine import LLM  # noqa: E402
from models import SPECS, bench_model_dir  # noqa: E402

# The outermost profiler event with one of these names owns its whole subtree.
CATEGORIES = {
    "GEMM": {"aten::linear", "aten::mm", "aten::addmm", "aten::matmul", "aten::bmm", "pagedserve::quant_linear",
             "pagedserve::dense_linear"},
    "attention": {"pagedserve::paged_attention"},
    "write_kv": {"pagedserve::write_kv"},
    "norm/rotary/act": {"pagedserve::rms_norm", "pagedserve::add_rms_norm", "pagedserve::rotary",
                        "pagedserve::silu_and_mul"},
    "sampling": {"sampling"},
}
OTHER_OPS = "other torch ops"
OVERHEAD = "python/scheduler"
COLUMNS = [*CATEGORIES, OTHER_OPS, OVERHEAD]


def _category(name: str) -> str | None:
    return next((c for c, names in CATEGORIES.items() if name in names), None)


def _wrap_sampling() -> None:
    """Label the runner's sampling call so its ops land in their own row (the runner is not edited)."""
    draw = engine.runner.draw

    def labelled(*args, **kwargs):
        with torch.profiler.record_function("sampling"):
            return draw(*args, **kwargs)

    engine.runner.draw = labelled


def _breakdown(prof, steps: int, wall_s: float) -> dict[str, float]:
    """Milliseconds per step per column. A category owns the outermost event with its name (nested ones
    are inside it); "other torch ops" is what the step's top-level events spent outside the categories."""
    totals: dict[str, float] = defaultdict(float)
    top_level = 0.0
    for event in prof.events():
        parent = event.cpu_parent
        if parent is not None and parent.name == "ProfilerStep":
            top_level += event.cpu_time_total
        owned = _category(event.name)
        while owned is not None and parent is not None:
            if _category(parent.name) is not None:
                owned = None
            parent = parent.cpu_parent
        if owned is not None:
            totals[owned] += event.cpu_time_total
    out = {c: totals[c] / 1e3 / steps for c in CATEGORIES}
    out[OTHER_OPS] = max(0.0, top_level - sum(totals.values())) / 1e3 / steps
    out[OVERHEAD] = max(0.0, wall_s * 1e3 / steps - sum(out.values()))
    return out


def _timed_steps(loop, steps: int) -> tuple[list[float], object, float]:
    """(unprofiled step times, profiler, profiled wall seconds) for `steps` + `steps` run_once calls."""
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        loop.run_once()
        times.append(time.perf_counter() - t0)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            with torch.profiler.record_function("ProfilerStep"):
                loop.run_once()
        wall = time.perf_counter() - t0
    return times, prof, wall


def profile_decode(loop, batch: int, context: int, steps: int) -> tuple[float, dict[str, float]]:
    prime_decoders(loop, batch, context, max_tokens=10_000)
    loop.run_once()                  # warm-up decode step
    before = generated(loop)
    times, prof, wall = _timed_steps(loop, steps)
    after = generated(loop)
    loop.stop()
    loop.run_until_idle()
    if after != {rid: n + 2 * steps for rid, n in before.items()}:
        raise RuntimeError(f"decode b={batch}: a measured step was not a pure decode step")
    return statistics.median(times), _breakdown(prof, steps, wall)


def profile_prefill(loop, tokens: int, steps: int) -> tuple[float, dict[str, float]]:
    """Each measured step prefills one fresh `tokens`-long prompt in a single chunk."""
    seeds = itertools.count(tokens)

    def one_chunk():
        prefill_once(loop, tokens, next(seeds))

    one_chunk()                      # warm-up
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        one_chunk()
        times.append(time.perf_counter() - t0)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            with torch.profiler.record_function("ProfilerStep"):
                one_chunk()
        wall = time.perf_counter() - t0
    return statistics.median(times), _breakdown(prof, steps, wall)


def _table(rows: list[tuple[str, str, float, dict[str, float]]]) -> str:
    head = f"{'case':<14}{'backend':<8}{'step wall':>11}" + "".join(f"{c:>18}" for c in COLUMNS)
    lines = [head, "-" * len(head)]
    for case, backend, wall, parts in rows:
        lines.append(f"{case:<14}{backend:<8}{wall * 1e3:>9.2f}ms"
                     + "".join(f"{parts[c]:>16.2f}ms" for c in COLUMNS))
    return "\n".join(lines)


def _speedups(rows) -> str:
    walls = {(case, backend): wall for case, backend, wall, _ in rows}
    lines = []
    for case in dict.fromkeys(case for case, _, _, _ in rows):
        if (case, "torch") in walls and (case, "cpp") in walls:
            lines.append(f"{case}: step {walls[(case, 'torch')] * 1e3:.2f} ms -> "
                         f"{walls[(case, 'cpp')] * 1e3:.2f} ms "
                         f"({walls[(case, 'torch')] / walls[(case, 'cpp')]:.2f}x)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="0.6b",
                        help=f"a bench model ({', '.join(sorted(SPECS))}) or any model spec: preset, checkpoint dir, .gguf")
    parser.add_argument("--quantization", choices=["auto", "none", "int8", "int4"], default="auto")
    parser.add_argument("--batch", type=int, nargs="*", default=[1, 8, 32])
    parser.add_argument("--prefill", type=int, nargs="*", default=[512])
    parser.add_argument("--context", type=int, default=128, help="prompt length before decoding")
    parser.add_argument("--steps", type=int, default=5, help="measured steps per case (x2: plain + profiled)")
    parser.add_argument("--backend", choices=["both", "torch", "cpp"], default="both")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--dtype", choices=["auto", "bfloat16", "float32"], default="auto",
                        help="auto: the engine's choice (bf16 only where the CPU has fast bf16)")
    args = parser.parse_args(argv)

    backends = ["torch", "cpp"] if args.backend == "both" else [args.backend]
    if "cpp" in backends and not ops.cpu.kernels_available():
        raise SystemExit("the C++ kernels did not build here (see the message above); use --backend torch")
    max_rows = max(args.batch or [1])
    max_len = max([args.context + 4 * args.steps + 8, *args.prefill]) + 16
    _wrap_sampling()
    model = str(bench_model_dir(args.model)) if args.model in SPECS else args.model
    llm = LLM(model=model, dtype=args.dtype, quantization=args.quantization, max_concurrency=max_rows,
              max_model_len=max_len, kv_pool_tokens=(max_rows + 1) * max_len, threads=args.threads,
              speculative="none")
    loop = llm.engine.loop
    print(f"model {args.model}, {llm.engine.dtype}, weights {llm.engine.weights}, {torch.get_num_threads()} threads, context {args.context}, "
          f"{args.steps} steps per case", flush=True)
    rows = []
    for batch in args.batch:
        for backend in backends:
            ops.cpu.use_backend(backend)
            wall, parts = profile_decode(loop, batch, args.context, args.steps)
            rows.append((f"decode b={batch}", backend, wall, parts))
            print(f"  decode b={batch} {backend}: {wall * 1e3:.2f} ms/step", flush=True)
    for tokens in args.prefill:
        for backend in backends:
            ops.cpu.use_backend(backend)
            wall, parts = profile_prefill(loop, tokens, max(2, args.steps // 2))
            rows.append((f"prefill {tokens}", backend, wall, parts))
            print(f"  prefill {tokens} {backend}: {wall * 1e3:.2f} ms/step", flush=True)
    llm.close()
    del llm
    gc.collect()
    print()
    print(_table(rows))
    if len(backends) == 2:
        print()
        print(_speedups(rows))


if __name__ == "__main__":
    main()
