"""Shared fixtures: tiny random checkpoints, each distinct variant built once per test session."""
from __future__ import annotations

import os

# Triton decides at `@triton.jit` time whether kernels run in its interpreter, so the switch must be
# set before any test module imports ops.triton; on a GPU (`make gpu-check`) the kernels run for real.
if os.environ.get("PAGEDSERVE_TEST_DEVICE", "cpu") == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"

import inspect
from pathlib import Path

import pytest

from tiny_models import make_checkpoint, make_hybrid_checkpoint

# hybrid shapes whose greedy output repeats itself (tied embeddings scaled up), for speculative decoding
REPEATING_HYBRIDS = {"qwen3_5": dict(arch="qwen3_5"), "qwen3_next": dict(arch="qwen3_next", linear_heads=(2, 2))}


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """`tiny_checkpoint("qwen3", tied=False, heads=8, kv_heads=2) -> Path`; takes make_checkpoint's
    arguments. Same variant (defaults filled in), same directory: treat it as read-only."""
    built: dict[str, Path] = {}
    signature = inspect.signature(make_checkpoint)

    def build(arch: str = "qwen3", **kwargs) -> Path:
        bound = signature.bind(None, arch, **kwargs)
        bound.apply_defaults()
        key = repr(sorted((k, v) for k, v in bound.arguments.items() if k != "directory"))
        if key not in built:
            built[key] = make_checkpoint(tmp_path_factory.mktemp(f"tiny-{arch}"), arch, **kwargs)
        return built[key]

    return build


@pytest.fixture(scope="session")
def repeating_hybrid(tmp_path_factory):
    """`repeating_hybrid("qwen3_5" | "qwen3_next") -> str`: a tiny Qwen3.5- or Qwen3-Next-shaped checkpoint
    whose greedy output runs in repeats, so n-gram proposals are both accepted and rejected."""
    built: dict[str, str] = {}

    def build(name: str) -> str:
        if name not in built:
            built[name] = str(make_hybrid_checkpoint(tmp_path_factory.mktemp(f"hybrid-{name}"), tied=True,
                                                     embed_scale=3.0, **REPEATING_HYBRIDS[name]))
        return built[name]

    return build


@pytest.fixture
def cpp_kernels():
    """The C++ CPU kernels registered for this test (and again after it, should it switch backends)."""
    import ops.cpu
    assert ops.cpu.kernels_available(), "the C++ kernels did not build on this machine (see ops.cpu's log line)"
    ops.cpu.use_backend("cpp")
    yield
    ops.cpu.use_backend("cpp")
