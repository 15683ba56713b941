"""The kernels built for the AVX2 baseline (what a Zen 3 runs) pass the kernel and model tests on an AVX-512
CPU too. Such a CPU otherwise runs the AVX2 paths only where a test caps `lanes` at 8, never inside a model
step: a prefill-only step of more than 64 tokens once crashed on AVX2 CPUs alone, unseen here."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import ops.cpu
from ops.cpu import build

ROOT = Path(__file__).resolve().parent.parent
# the files whose paths differ between the builds: the kernels against their references, and the models
# (dense, quantized, hybrid, speculative) against transformers or their plain runs
SUITE = ["test_cpu_kernels.py", "test_kv_quant.py", "test_kv_cache_dtype.py", "test_quant_linear.py",
         "test_quant_rows.py", "test_quant_dense.py",
         "test_model_equivalence.py", "test_kv_cache_fidelity.py", "test_hybrid_models.py",
         "test_hybrid_speculation.py", "test_speculation_models.py", "test_pointwise.py", "test_ops.py"]
ENV = {**os.environ, build.MARCH_ENV: "x86-64-v3"}


def _run(*args: str, timeout: int) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=ENV, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.skipif("avx512" not in ops.cpu.INSTRUCTION_SETS,
                    reason="the kernels here have no AVX-512: the whole suite already runs the AVX2 build")
def test_the_avx2_build_passes_the_kernel_and_model_tests():
    # builds it (about a minute on 2 cores, cached after), and checks it is what the CPU of a Zen 3 gets
    sets = _run("-c", "import ops.cpu; print(sorted(ops.cpu.INSTRUCTION_SETS), ops.cpu.KERNEL_ROW_TOKENS)",
                timeout=900)
    assert sets.returncode == 0, sets.stderr[-3000:]
    assert sets.stdout.strip().splitlines()[-1] == "['avx2'] 64", sets.stdout + sets.stderr[-3000:]
    tests = _run("-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *[f"tests/{name}" for name in SUITE],
                 timeout=900)
    assert tests.returncode == 0, tests.stdout[-6000:] + tests.stderr[-2000:]
