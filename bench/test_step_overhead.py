"""Engine overhead per step (bench/step_overhead.py: a nearly free 1-layer model, fp32) at 1 and 32
streams, context 128 and 8,192; with `--step-baseline DIR` an older checkout is measured in
alternating rounds in the same minutes and reported beside this one.

    git worktree add /tmp/old <commit>
    .venv/bin/python -m pytest bench/test_step_overhead.py -q -p no:cacheprovider --step-baseline /tmp/old
"""
from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROUNDS = 3


def _run(checkout: Path, bandwidth: float) -> list[dict]:
    out = subprocess.run([sys.executable, str(BENCH / "step_overhead.py"), "--checkout", str(checkout),
                          "--json", "--bandwidth-gbs", str(bandwidth)],
                         check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def test_step_overhead(bench_report, request):
    from roofline import measure_bandwidth_gb_s
    bandwidth = measure_bandwidth_gb_s()
    trees = {"this checkout": BENCH.parent}
    if request.config.getoption("--step-baseline"):
        trees["baseline"] = Path(request.config.getoption("--step-baseline"))
    runs: dict[str, list[list[dict]]] = {name: [] for name in trees}
    for _ in range(ROUNDS):
        for name, tree in trees.items():
            runs[name].append(_run(tree, bandwidth))
    for i, case in enumerate(runs["this checkout"][0]):
        group = f"step overhead {case['streams']} x {case['context']}"
        for name in trees:
            ms = statistics.median(r[i]["step_ms"] for r in runs[name])
            bench_report.add(group, name, ms, "ms", subject=name == "this checkout",
                             note=f"K/V read {case['kv_read_ms']:.2f} ms at {bandwidth:.0f} GB/s"
                             if name == "this checkout" else "")
