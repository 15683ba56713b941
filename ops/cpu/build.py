"""Compile the C++ kernels (.cpp, with their .h) in this folder into one torch extension, once per source/CPU/torch combination.

The build goes to the user cache dir, keyed by a hash of the sources, their folder and the flags, the
CPU's feature flags (the code is built with -march=native, so a cache shared between machines must not
mix them) and the torch version; a later process finds it there and loads it in milliseconds.
PAGEDSERVE_CPU_MARCH sets another -march (x86-64-v3: the AVX2 baseline, what a Zen 3 runs, on any newer CPU);
the kernels report what they were built for (`instruction_sets` in ops/cpu/__init__.py).
"""
from __future__ import annotations

import hashlib
import os
import platform
import time
from pathlib import Path

import platformdirs
import torch

SOURCE_DIR = Path(__file__).resolve().parent
# -ffp-contract=off: rotary must round each product like the torch body does; no FMA may fuse them.
# -fopenmp: at::parallel_for is an OpenMP pragma in ATen's headers; without it every kernel runs on one
# thread (measured: quant_linear took the same time on 1 and 2 threads). At run time the libgomp.so.1
# that libtorch has already loaded serves it.
MARCH_ENV = "PAGEDSERVE_CPU_MARCH"
CFLAGS = ["-O3", f"-march={os.environ.get(MARCH_ENV) or 'native'}", "-fopenmp", "-ffp-contract=off"]
LDFLAGS = ["-fopenmp"]
STALE_LOCK_S = 900          # a build lock older than this was left by a killed build
LIBRARY = "pagedserve_cpu"      # the namespace the .cpp files register their ops under


def _cpu_identity() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _build_key(sources: list[Path]) -> str:
    # the folder too: ninja rebuilt a build dir each time another checkout's paths loaded it (a bench
    # alternating two worktrees compiled every run)
    digest = hashlib.sha256(str(SOURCE_DIR).encode())
    headers = sorted(SOURCE_DIR.glob("*.h"))
    for part in [*(p.read_bytes() for p in [*sources, *headers]), " ".join(CFLAGS).encode(), _cpu_identity().encode(),
                 torch.__version__.encode()]:
        digest.update(part)
    return digest.hexdigest()[:16]


def build_dir_root() -> Path:
    return platformdirs.user_cache_path("pagedserve") / "cpu_kernels"


def load_extension():
    """Build (or find) and load the extension; returns `torch.ops.pagedserve_cpu`. Raises whatever the
    compiler or loader raised when that fails (no compiler, no ninja, a compile error)."""
    from torch.utils import cpp_extension

    sources = sorted(SOURCE_DIR.glob("*.cpp"))
    name = f"{LIBRARY}_{_build_key(sources)}"
    directory = build_dir_root() / name
    directory.mkdir(parents=True, exist_ok=True)
    lock = directory / "lock"       # torch waits on an existing lock forever, even one nobody holds
    if lock.exists() and time.time() - lock.stat().st_mtime > STALE_LOCK_S:
        lock.unlink(missing_ok=True)
    cpp_extension.load(name=name, sources=[str(p) for p in sources], extra_cflags=CFLAGS, extra_ldflags=LDFLAGS,
                       build_directory=str(directory), is_python_module=False, verbose=False)
    return getattr(torch.ops, LIBRARY)
