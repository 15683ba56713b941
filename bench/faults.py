"""The fault suite, run on demand: processes killed with SIGKILL at random moments (a server during
its first GGUF conversion and in mid-stream; writers of session files, config files, prefix-cache
snapshots and preset pulls) and steps that raise through the debug hook. It prints every kill and what it left behind,
and exits 1 if any persisted file was torn, a restart did not serve, or a failed step left anything
in use. bench/fault_kills.py and bench/fault_steps.py hold the checks.

    .venv/bin/python bench/faults.py                          # everything, seed 0
    .venv/bin/python bench/faults.py --only gguf,stream --kills 12 --seed 3
    .venv/bin/python bench/faults.py --gguf ~/.cache/pagedserve/models/smollm2-135m/*.gguf

The "control" writer replaces its file in place (open, truncate, write), as the code did before
engine/atomic_file.py: its tears are counted, never failed on, and show the kills land mid-write.
"""
from __future__ import annotations

import argparse
import random
import shlex
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path[:0] = [str(BENCH), str(BENCH.parent), str(BENCH.parent / "tests")]   # engine, server_process

import fault_kills  # noqa: E402
from fault_steps import step_failures  # noqa: E402

SHARED_GGUF = BENCH.parent.parent / "shared" / "testdata" / "gguf" / "qwen2-K-Q8_0.gguf"
SUITES = ("gguf", "stream", "session", "config", "snapshot", "control", "preset", "steps")
TINY = dict(tied=False, heads=8, kv_heads=2, head_dim=32, max_pos=2048)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default=",".join(SUITES), help=f"comma-separated suites (default all: {','.join(SUITES)})")
    p.add_argument("--kills", type=int, default=8, help="server kills per server suite (default 8; "
                   "writers get 4x as many, preset pulls half)")
    p.add_argument("--seed", type=int, default=0, help="seed of the kill moments")
    p.add_argument("--gguf", type=Path, default=SHARED_GGUF, help="the GGUF the server converts")
    p.add_argument("--workdir", type=Path, default=None, help="where caches, files and logs go (default: a temp dir)")
    args = p.parse_args(argv)
    unknown = set(args.only.split(",")) - set(SUITES)
    if unknown:
        p.error(f"--only: unknown suite(s) {sorted(unknown)}; choose from {','.join(SUITES)}")
    return args


def run_suite(name: str, args: argparse.Namespace, rng: random.Random, workdir: Path) -> tuple[list[str], list[str]]:
    where = workdir / name
    where.mkdir(parents=True, exist_ok=True)
    if name == "gguf":
        return fault_kills.gguf_conversion(args.gguf, args.kills, rng, where)
    if name == "stream":
        env = fault_kills.cache_home(where / "home")
        return fault_kills.mid_stream(args.gguf, max(1, args.kills // 2), rng, where, env)
    if name in fault_kills.WRITERS:
        return fault_kills.writer_kills(name, 4 * args.kills, rng, where)
    if name == "preset":
        return fault_kills.preset_pull(max(1, args.kills // 2), rng, where)
    from tiny_models import make_checkpoint
    return step_failures(make_checkpoint(where / "tiny-qwen3", "qwen3", **TINY), where)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    print("command:", shlex.join([sys.executable, *sys.argv]))
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="pagedserve-faults-"))
    print(f"work dir {workdir} (server logs and caches stay there)")
    rng, failed = random.Random(args.seed), []
    for name in args.only.split(","):
        began = time.monotonic()
        lines, problems = run_suite(name, args, rng, workdir)
        print(f"\n== {name}: {len(lines)} runs, {len(problems)} "
              f"{'tears (expected: in-place writes)' if name == 'control' else 'problems'}, "
              f"{time.monotonic() - began:.0f} s")
        for line in lines:
            print("  " + line)
        if name != "control":
            failed += [f"{name}: {p}" for p in problems]
    print("\nverdict:", "PASS" if not failed else f"FAIL ({len(failed)}):\n  " + "\n  ".join(failed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
