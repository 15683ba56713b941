"""Soak: one `pagedserve serve` on loopback under a mixed, seeded HTTP workload for `--minutes`, then
the checks a long run must pass: no 5xx, nothing left in use once the load has drained (K/V blocks,
state slots, rows, queue), TTFT/ITL that do not drift from the first window to the last, and no job
that went wrong (bench/soak_workload.py says what each kind of job expects). Exit status 1 if a
check fails. It also prints the server's RSS at the start, after each window and at the end.

    .venv/bin/python bench/soak.py                        # 20 minutes on a tiny random checkpoint
    .venv/bin/python bench/soak.py --minutes 2 --window-minutes 0.5 --rate 4
    .venv/bin/python bench/soak.py --model smollm2-135m --rate 0.5
    .venv/bin/python bench/soak.py --minutes 3 --serve-args "--prefix-cache-dir /tmp/soak-cache --prefix-cache-save-interval-s 0.2"

Timings on a shared CPU move with whatever else runs: read the drift line next to the machine's load.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx
import psutil

BENCH = Path(__file__).resolve().parent
sys.path[:0] = [str(BENCH), str(BENCH.parent), str(BENCH.parent / "tests")]   # loadgen, engine, server_process

from server_process import ServerProcess  # noqa: E402
from soak_report import drift, problem_summary, table, windows  # noqa: E402
from soak_workload import MODEL, Outcome, draw_jobs, run_job  # noqa: E402

DRAIN_TIMEOUT_S = 300.0        # in-flight jobs after the last arrival
IDLE_TIMEOUT_S = 60.0          # the server's table to empty after that
TINY = dict(tied=False, heads=8, kv_heads=2, head_dim=32, max_pos=2048)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=20.0, help="how long jobs keep arriving (default 20)")
    p.add_argument("--window-minutes", type=float, default=5.0, help="width of a report window (default 5)")
    p.add_argument("--rate", type=float, default=3.0, help="job arrivals per second, Poisson (default 3)")
    p.add_argument("--max-requests", type=int, default=20_000, help="stop arrivals after this many jobs")
    p.add_argument("--seed", type=int, default=0, help="seed of the arrivals, lengths and behaviours")
    p.add_argument("--model", default="", help="a preset, checkpoint dir or .gguf (default: a tiny random "
                   "checkpoint built in the work dir)")
    p.add_argument("--max-concurrency", type=int, default=8)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--kv-pool-tokens", type=int, default=2048, help="0 = the server's own sizing; the "
                   "default is small enough that long jobs preempt each other now and then")
    p.add_argument("--threads", type=int, default=1, help="the server's torch threads (default 1: the "
                   "load generator needs the other core)")
    p.add_argument("--workdir", type=Path, default=None, help="where the model and the server log go")
    p.add_argument("--serve-args", default="", help="more `pagedserve serve` flags, as one shell-quoted string")
    return p.parse_args(argv)


def start_server(args: argparse.Namespace, workdir: Path) -> ServerProcess:
    if args.model:
        model, dtype = args.model, "auto"
    else:
        from tiny_models import make_checkpoint
        model, dtype = make_checkpoint(workdir / "tiny-qwen3", "qwen3", **TINY), "float32"
    server = ServerProcess(model, "--max-concurrency", str(args.max_concurrency), "--threads", str(args.threads),
                           "--served-model-name", MODEL, *shlex.split(args.serve_args),
                           dtype=dtype, max_model_len=args.max_model_len, kv_pool_tokens=args.kv_pool_tokens,
                           workdir=workdir)
    try:
        server.wait_ready()
    except BaseException:
        server.stop()
        raise
    return server


async def run_load(server: ServerProcess, args: argparse.Namespace) -> tuple[list[Outcome], list[int]]:
    """Every job, and the server's RSS at the end of each window (the last one after the drain)."""
    rss = psutil.Process(server.proc.pid)
    jobs = draw_jobs(args.seed, args.rate, args.minutes * 60, args.max_requests)
    limits = httpx.Limits(max_connections=512, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=server.url, limits=limits, trust_env=False,
                                 timeout=httpx.Timeout(120.0, connect=30.0)) as client:
        start = time.perf_counter()
        tasks = [asyncio.ensure_future(run_job(client, job, start)) for job in jobs]
        window_s, rss_at_ends = args.window_minutes * 60, []
        while (len(rss_at_ends) + 1) * window_s < args.minutes * 60:
            await asyncio.sleep(max(0.0, start + (len(rss_at_ends) + 1) * window_s - time.perf_counter()))
            rss_at_ends.append(rss.memory_info().rss)
        done, pending = await asyncio.wait(tasks, timeout=args.minutes * 60 + DRAIN_TIMEOUT_S)
        for task in pending:
            task.cancel()
        if pending:
            print(f"{len(pending)} jobs still running {DRAIN_TIMEOUT_S:.0f} s after the last arrival: cancelled")
        rss_at_ends.append(rss.memory_info().rss)
    return [t.result() for t in tasks if t in done], rss_at_ends


def wait_idle(server: ServerProcess) -> dict:
    """The table's stats once nothing runs or waits (or after IDLE_TIMEOUT_S)."""
    deadline = time.monotonic() + IDLE_TIMEOUT_S
    while True:
        stats = httpx.get(server.url + "/v1/requests", timeout=30).json()["stats"]
        if stats["running"] == stats["waiting"] == 0 or time.monotonic() > deadline:
            return stats
        time.sleep(0.2)


def _load() -> str:
    """The machine's load: other work on the same cores moves every timing."""
    return "load average " + " ".join(f"{x:.2f}" for x in os.getloadavg()) + f" on {os.cpu_count()} cores"


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    print("command:", shlex.join([sys.executable, *sys.argv]))
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="pagedserve-soak-"))
    workdir.mkdir(parents=True, exist_ok=True)
    server = start_server(args, workdir)
    print(f"server pid {server.proc.pid} on {server.url}; log {server.log.name}; {_load()}")
    rss_start = psutil.Process(server.proc.pid).memory_info().rss
    try:
        outcomes, rss_at_ends = asyncio.run(run_load(server, args))
        stats = wait_idle(server)
    finally:
        exit_code = server.stop()
    return report(outcomes, rss_start, rss_at_ends, stats, exit_code, args)


def report(outcomes: list[Outcome], rss_start: int, rss_at_ends: list[int], stats: dict, exit_code: int,
           args: argparse.Namespace) -> int:
    rows = windows(outcomes, args.window_minutes * 60, rss_at_ends)
    print(table(rows))
    kinds = Counter(o.job.behaviour for o in outcomes)
    left = {k: stats[k] for k in ("blocks_used", "slots_used", "running", "waiting")}
    server_errors = sum(w.server_errors for w in rows)
    routes = Counter(o.job.route for o in outcomes)
    print(f"jobs {len(outcomes)}: " + ", ".join(f"{kind} {n}" for kind, n in kinds.most_common())
          + "; " + ", ".join(f"{route} {n}" for route, n in routes.most_common()))
    print(f"server RSS {rss_start / 2**20:.0f} MiB at start, {rss_at_ends[-1] / 2**20:.0f} MiB at the end; "
          f"{_load()}")
    print(f"after the drain: {left}; preemptions {stats['preemptions_total']}, steps {stats['steps_total']}; "
          f"server exit status {exit_code}")
    print(f"5xx responses: {server_errors} (besides {sum(o.cancelled_by_server for o in outcomes)} answers "
          "to our own cancels, 503 code cancelled)")
    problems = problem_summary(outcomes)
    for line in problems:
        print("problem:", line)
    failed = verdict(server_errors, left, drift(rows), sum(w.problems for w in rows), exit_code)
    print("verdict:", "PASS" if not failed else "FAIL: " + "; ".join(failed))
    return 1 if failed else 0


def verdict(server_errors: int, left: dict, drifted: list[str], problems: int, exit_code: int) -> list[str]:
    """The checks that failed; empty when the run passed."""
    return ([f"{server_errors} 5xx"] if server_errors else []) + \
        ([f"left in use after the drain: {left}"] if any(left.values()) else []) + drifted + \
        ([f"{problems} jobs went wrong"] if problems else []) + \
        ([f"server exit status {exit_code}"] if exit_code != 0 else [])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
