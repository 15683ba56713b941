"""Engine overhead per step: the wall time of one engine-loop iteration (commands, schedule, batch,
forward, sample, apply, detokenize) with a model whose forward is nearly free (1 layer, hidden 64,
2 heads of 32), at a few stream counts and context lengths. fp32, greedy, EOS ignored.

It imports `engine` from `--checkout`, so the same file measures an old commit in a worktree:

    git worktree add /tmp/old <commit>
    .venv/bin/python bench/step_overhead.py --checkout /tmp/old --json     # one JSON line
    .venv/bin/python bench/step_overhead.py                                # this checkout, a table
    .venv/bin/python bench/step_overhead.py --engine overlap_scheduling=on  # an engine config key set

Every stream has a prompt of its own (no prefix sharing, so each row's K/V is its own and attention
really reads it from memory). `kv_read_ms` is the K/V those rows read per step at `--bandwidth-gbs`
(the attention kernel's own cost, the one part that should grow with context).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
LAYERS, HIDDEN, HEADS, HEAD_DIM = 1, 64, 2, 32


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkout", type=Path, default=BENCH.parent, help="the tree whose engine is measured")
    p.add_argument("--model-dir", type=Path, default=None, help="the tiny checkpoint (built if missing)")
    p.add_argument("--streams", type=int, nargs="+", default=[1, 32])
    p.add_argument("--contexts", type=int, nargs="+", default=[128, 8192])
    p.add_argument("--steps", type=int, default=60, help="timed steps per case (after 5 warm-up steps)")
    p.add_argument("--bandwidth-gbs", type=float, default=0.0,
                   help="memory read bandwidth for kv_read_ms (default: measured, fp32 read)")
    p.add_argument("--engine", nargs="*", default=[], metavar="KEY=VALUE",
                   help="engine config keys for every case, e.g. overlap_scheduling=on")
    p.add_argument("--json", action="store_true", help="one JSON line instead of a table")
    return p.parse_args(argv)


def ensure_model(path: Path | None) -> Path:
    path = path or Path.home() / ".cache" / "pagedserve" / "bench" / "step-overhead-l1-h64"
    if not (path / "config.json").exists():
        sys.path.insert(0, str(BENCH.parent / "tests"))
        import torch
        from tiny_models import make_checkpoint
        make_checkpoint(path, tied=False, hidden=HIDDEN, layers=LAYERS, heads=HEADS, kv_heads=HEADS,
                        head_dim=HEAD_DIM, intermediate=128, max_pos=16384, dtype=torch.float32)
    return path


def measure(model: Path, streams: int, context: int, steps: int, engine: dict) -> tuple[list[float], int]:
    """Seconds per loop iteration over `steps` decode steps with `streams` rows at ~`context` tokens,
    and the K/V bytes one token takes in the engine's cache (its kv_cache_dtype)."""
    from engine.llm import LLM
    from engine.request import SamplingParams

    warm, spare = 5, 64          # spare: tokens the first streams make while the others prefill
    reply = warm + steps + spare
    llm = LLM(str(model), dtype="float32", max_concurrency=streams, max_model_len=context + reply,
              kv_pool_tokens=streams * (context + reply + 32), prefix_cache=False, **engine)
    loop = llm.engine.loop
    params = SamplingParams(temperature=0.0, max_tokens=reply, ignore_eos=True)
    handles = [loop.submit([(i * 7 + s * 13) % 400 + 10 for i in range(context)], params, bounded=False)
               for s in range(streams)]
    while not all(h.lag for h in handles):      # every stream has its first token
        loop.run_once()
    if any(h.finished for h in handles):
        raise RuntimeError("a stream finished before the timed steps; raise `spare`")
    for _ in range(warm):
        loop.run_once()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        loop.run_once()
        times.append(time.perf_counter() - t0)
    shape = llm.engine.pool.shape
    llm.close()
    return times, shape.bytes_per_block // shape.block_size


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    model = ensure_model(args.model_dir)
    if not args.bandwidth_gbs:
        from roofline import measure_bandwidth_gb_s
        args.bandwidth_gbs = measure_bandwidth_gb_s()
    sys.path.insert(0, str(args.checkout.resolve()))
    from engine.config_file import parse_value
    engine = {k: parse_value(k, v) for k, v in (kv.split("=", 1) for kv in args.engine)}
    results = []
    for streams in args.streams:
        for context in args.contexts:
            times, token_bytes = measure(model, streams, context, args.steps, engine)
            kv_bytes = streams * context * token_bytes
            results.append(dict(streams=streams, context=context,
                                step_ms=round(statistics.median(times) * 1e3, 3),
                                kv_read_ms=round(kv_bytes / (args.bandwidth_gbs * 1e9) * 1e3, 3),
                                bandwidth_gbs=round(args.bandwidth_gbs, 1)))
    if args.json:
        print(json.dumps(results))
        return
    print(f"{'streams':>8} {'context':>8} {'step ms':>9} {'K/V read ms':>12}   ({args.checkout})")
    for r in results:
        print(f"{r['streams']:>8} {r['context']:>8} {r['step_ms']:>9.3f} {r['kv_read_ms']:>12.3f}")


if __name__ == "__main__":
    main(sys.argv[1:])
