"""How every launcher in ops.triton starts its kernels, so the same code runs eagerly, under the Triton
interpreter (CPU tests) and inside `torch.compile` traces on GPUs."""
from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl
from torch.library import wrap_triton


def launchable(kernel: Any) -> Any:
    """`wrap_triton(kernel)` for compiled kernels, so a `torch.library.triton_op` body traced by inductor
    records the launch instead of running it; the kernel itself under TRITON_INTERPRET=1, where kernels are
    `InterpretedFunction`s that `wrap_triton` rejects (and the interpreter cannot run on traced tensors)."""
    if isinstance(kernel, triton.runtime.JITFunction):
        return wrap_triton(kernel)
    return kernel


def pow2(n: int, at_least: int = 1) -> int:
    """Triton block shapes must be powers of two: the smallest one >= max(n, at_least)."""
    return triton.next_power_of_2(max(int(n), at_least))


def interpreting() -> bool:
    """True under TRITON_INTERPRET=1 (decided when the kernels were decorated, as Triton does)."""
    return not isinstance(mma, triton.runtime.JITFunction)


def fp32_dot(dtype: torch.dtype) -> bool:
    """Whether kernels must run their tl.dot in fp32: fp32 inputs (IEEE, not TF32, to match the references)
    and everything under the interpreter, whose bf16 dot multiplies the raw uint16 bit patterns (Triton 3.9).
    bf16 products are exact in fp32, so the upcast computes what the GPU's bf16 dot with fp32 accumulation does."""
    return dtype == torch.float32 or interpreting()


@triton.jit
def mma(a, b, F32: tl.constexpr):
    """a @ b accumulated in fp32; F32 upcasts the inputs first (see fp32_dot)."""
    if F32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def row_of_tile(qsl_ptr, num_rows, tile, BLOCK_Q: tl.constexpr):
    """The row of a flat varlen batch that owns `tile` when row i's tiles start at qsl[i] // BLOCK_Q + i."""
    # Row i's tiles start at qsl[i] // BLOCK_Q + i (monotone, and leaves each row >= ceil(n_i / BLOCK_Q)
    # tiles); the owner of `tile` is the last row whose start is <= tile. Binary search, no host help.
    # tensors from the start: the loop-carried values must keep one type (an int arg equal to 1 is a constexpr)
    lo = tl.full([], 0, tl.int32)
    hi = tl.full([], 0, tl.int32) + num_rows - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if tl.load(qsl_ptr + mid) // BLOCK_Q + mid <= tile:
            lo = mid
        else:
            hi = mid - 1
    return lo
