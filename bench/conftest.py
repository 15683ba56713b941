"""Bench options, shared fixtures (checkpoint, machine roofline, transformers model) and the table
printed at the end of the run (also saved as .benchmarks/report-<timestamp>.json)."""
from __future__ import annotations

import gc
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

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
    group.addoption("--step-baseline", default="",
                    help="test_step_overhead.py: a checkout (e.g. a git worktree of an older commit) "
                         "measured alternately with this one")
    group.addoption("--bench-dtype", choices=("auto", "bfloat16", "float32"), default="auto",
                    help="dtype of ours and of the transformers baseline; auto = the engine's choice "
                         "(bfloat16 where the CPU has fast bf16, else float32)")


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
def bench_dtype(request) -> str:
    """The dtype name every measurement in this run uses, engine and baseline alike."""
    choice = request.config.getoption("--bench-dtype")
    if choice != "auto":
        return choice
    from engine.builder import cpu_has_fast_bf16
    return "bfloat16" if cpu_has_fast_bf16() else "float32"


@pytest.fixture(scope="session")
def bench_checkpoint(request) -> Path:
    return bench_model_dir(request.config.getoption("--bench-model"))


@pytest.fixture(scope="session", autouse=True)
def machine(bench_report, bench_dtype):
    """Measured once, first, before any model is in memory."""
    m = measure_machine(dtype=getattr(torch, bench_dtype))
    bench_report.machine = asdict(m)
    bench_report.add("machine", "memory bandwidth", m.bandwidth_gb_s, "GB/s",
                     note=f"tensor copy/sum, {m.threads} threads, best of 5")
    bench_report.add("machine", f"{bench_dtype} GEMM {m.gemm_size}^3", m.gemm_gflop_s, "GFLOP/s",
                     note=f"{m.threads} threads, best of 5")
    return m


@pytest.fixture(scope="session")
def hf_model(bench_checkpoint, bench_dtype):
    from hf_baseline import hf_generate_s, load_hf_model

    model = load_hf_model(bench_checkpoint, getattr(torch, bench_dtype))
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
