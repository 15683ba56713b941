"""pagedserve::quant_linear (int4, int6, int8) next to fp32 F.linear for Qwen2.5-1.5B's MLP shapes, and at M=1
the fraction of the memory roofline (bytes of qweight + scales + mins at the measured bandwidth). "int4" and
"int8" have two-level scales (Q4_K's form); "int4-flat" is the same weight with fp32 scales and mins per
group (Q4_0/Q4_1's form), 26 % more bytes. "int6" is Q6_K's form (random values and sub-scales), the
form a Q4_K_M file's Q6_K layers keep; "int8" is what they took before.

Each timed call uses the next of several copies of the weights, together larger than the L3 cache,
so M=1 streams from memory as in a real decode step (a model's weights never fit in L3)."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

import ops.cpu
from ops.quant_linear import quant_linear
from ops.quant_weight import GROUP, HALF, QuantizedWeight, quantize_int4, quantize_int8
from decode_steps import Timed

SHAPES = ((8960, 1536), (1536, 8960))      # (out_features, in_features): gate/up and down projections
ROWS = (1, 8, 64)
KINDS = ("fp32", "int8", "int6", "int4-flat", "int4")
ROTATION_BYTES = 128 << 20                 # all copies together: well past a 32 MiB L3
ROUNDS = {1: 40, 8: 20, 64: 10}


def _q6_k_like(n: int, k: int) -> QuantizedWeight:
    g = torch.Generator().manual_seed(0)
    return QuantizedWeight.from_groups(torch.randint(0, 64, (n, k), generator=g, dtype=torch.uint8),
                                       torch.randint(-128, 128, (n, k // HALF), generator=g, dtype=torch.int8),
                                       None, 6, torch.rand(n, k // (8 * GROUP), 1, generator=g) * 1e-3)


def _copies(n: int, k: int, kind: str) -> list:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(0)) * 0.05
    if kind == "fp32":
        one, size = w, w.numel() * 4
    elif kind == "int6":
        one = _q6_k_like(n, k)
        size = one.nbytes
    else:
        one = (quantize_int8 if kind == "int8" else quantize_int4)(w)
        one = one.flattened() if kind == "int4-flat" else one
        size = one.nbytes
    count = max(2, -(-ROTATION_BYTES // size))
    if kind == "fp32":
        return [one.clone() for _ in range(count)]
    def clone(t):
        return None if t is None else t.clone()
    return [replace(one, qweight=one.qweight.clone(), scales=one.scales.clone(), mins=clone(one.mins),
                    supers=clone(one.supers)) for _ in range(count)]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_quant_linear(benchmark, machine, bench_report, shape, m, kind):
    assert ops.cpu.kernels_available(), "the C++ kernels did not build (see ops.cpu's log line)"
    ops.cpu.use_backend("cpp")
    n, k = shape
    weights = _copies(n, k, kind)
    x = torch.randn(m, k)
    turn = iter(range(10**9))
    if kind == "fp32":
        def call():
            return F.linear(x, weights[next(turn) % len(weights)])
    else:
        def call():
            return quant_linear(x, weights[next(turn) % len(weights)])
    group = f"{n}x{k} M={m}"
    benchmark.group = group
    step = Timed(call)
    with torch.inference_mode():
        for _ in weights:               # first touch of every copy stays out of the timings
            call()
        benchmark.pedantic(step, rounds=ROUNDS[m], iterations=1)
    ms = step.median * 1e3
    nbytes = n * k * 4 if kind == "fp32" else weights[0].nbytes
    roof_ms = nbytes / (machine.bandwidth_gb_s * 1e9) * 1e3
    note = f"median of {len(step.times)}, {nbytes / 2**20:.1f} MiB weights"
    if m == 1:
        note += f", {roof_ms / ms:.0%} of the {machine.bandwidth_gb_s:.1f} GB/s roofline"
    benchmark.extra_info.update(ms=ms, roofline_ms=roof_ms)
    bench_report.add(group, kind if kind != "fp32" else "fp32 F.linear", ms, "ms", subject=kind == "int4", note=note)
