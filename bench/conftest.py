"""Bench options, shared fixtures (checkpoint, machine roofline, transformers model) and the table
printed at the end of the run (also saved as .benchmarks/report-<timestamp>.json)."""
from __future__ import annotations

import gc
import sys
from dataclasses import asdict
from pathlib import Path

import pytest

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR.parent))     # `engine` from this checkout, also without `pip -e`

from models import SPECS, bench_model_dir  # noqa: E402
from report import BenchReport  # noqa: E402
from roofline import measure_machine  # noqa: E402

REPORT_KEY = pytest.StashKey[BenchReport]()


def pytest_addoption(parser):
    group = parser.getgroup("pagedserve bench")
    group.addoption("--bench-model", choices=sorted(SPECS), default="0.6b",
                    help="random checkpoint to measure: 0.6b (Qwen3-0.6B shapes) or mini (4 layers)")
    group.addoption("--bench-new-tokens", type=int, default=128,
                    help="new tokens per request in the serving load runs (fewer for quick runs)")


def pytest_configure(config):
    config.stash[REPORT_KEY] = BenchReport(model=config.getoption("--bench-model"))


@pytest.fixture(scope="session")
def bench_report(request) -> BenchReport:
    return request.config.stash[REPORT_KEY]


@pytest.fixture(scope="session")
def bench_new_tokens(request) -> int:
    n = request.config.getoption("--bench-new-tokens")
    if n < 2:
        raise pytest.UsageError(f"--bench-new-tokens {n}: use at least 2")
    return n


@pytest.fixture(scope="session")
def bench_checkpoint(request) -> Path:
    return bench_model_dir(request.config.getoption("--bench-model"))


@pytest.fixture(scope="session", autouse=True)
def machine(bench_report):
    """Measured once, first, before any model is in memory."""
    m = measure_machine()
    bench_report.machine = asdict(m)
    bench_report.add("machine", "memory bandwidth", m.bandwidth_gb_s, "GB/s",
                     note=f"tensor copy/sum, {m.threads} threads, best of 5")
    bench_report.add("machine", f"bf16 GEMM {m.gemm_size}^3", m.gemm_gflop_s, "GFLOP/s",
                     note=f"{m.threads} threads, best of 5")
    return m


@pytest.fixture(scope="session")
def hf_model(bench_checkpoint):
    from hf_baseline import hf_generate_s, load_hf_model

    model = load_hf_model(bench_checkpoint)
    hf_generate_s(model, [[5] * 8], 2)        # first-call costs stay out of the measurements
    yield model
    del model
    gc.collect()


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    report = config.stash.get(REPORT_KEY, None)
    if report is None or not report.rows:
        return
    terminalreporter.section(f"pagedserve bench ({report.model}): ours next to same-run baselines")
    terminalreporter.write_line(report.table())
    path = report.save_json(config.rootpath / ".benchmarks")
    terminalreporter.write_line(f"saved {path}")
