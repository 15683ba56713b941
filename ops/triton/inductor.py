"""Let inductor see (and fuse around, and CUDA-graph) the Triton kernels behind pagedserve's ops on GPUs.

The pagedserve ops are opaque `custom_op`s: compiled, they run as extern calls into Python. Here each
launcher also becomes a `torch.library.triton_op` (`pagedserve_triton::<op>`, launches through
`wrap_triton`), and each pagedserve op gets a FunctionalTensorMode rule that, for CUDA tensors, runs that
triton_op instead, which AOTAutograd then decomposes into its kernel launches, exactly as it does for a
triton_op called directly. CPU tensors keep the op's normal (opaque) path. Under TRITON_INTERPRET=1 a
traced triton_op cannot run (the interpreter would run on fake tensors), which is why CPU tensors never
take this route and why the CPU tests check only that the rule leaves them alone.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch._library.custom_ops import CustomOpDef
from torch._subclasses.functional_tensor import FunctionalTensor, FunctionalTensorMode
from torch._subclasses.fake_tensor import FakeTensor

import ops
from ops.triton.causal_conv1d import causal_conv1d
from ops.triton.gated_delta_rule import gated_delta_rule
from ops.triton.paged_attention import paged_attention
from ops.triton.rms_norm import add_rms_norm, rms_norm
from ops.triton.rotary import rotary
from ops.triton.silu_and_mul import silu_and_mul
from ops.triton.write_kv import write_kv

NAMESPACE = "pagedserve_triton"

# op -> (its CustomOpDef, the launcher, the launcher's mutated args: the same as the op's)
_OPS: dict[str, tuple[CustomOpDef, Callable, tuple[str, ...]]] = {
    "paged_attention": (ops.paged_attention.paged_attention, paged_attention, ()),
    "write_kv": (ops.write_kv.write_kv, write_kv, ("k_cache", "v_cache")),
    "rms_norm": (ops.rms_norm.rms_norm, rms_norm, ()),
    "add_rms_norm": (ops.rms_norm.add_rms_norm, add_rms_norm, ()),
    "rotary": (ops.rotary.rotary, rotary, ()),
    "silu_and_mul": (ops.silu_and_mul.silu_and_mul, silu_and_mul, ()),
    "gated_delta_rule": (ops.gated_delta_rule.gated_delta_rule, gated_delta_rule, ("state_pool", "checkpoints")),
    "causal_conv1d": (ops.causal_conv1d.causal_conv1d, causal_conv1d, ("conv_state", "checkpoints")),
}
_exposed = False


def _on_cuda(args: tuple[Any, ...]) -> bool:
    first = next((a for a in args if isinstance(a, torch.Tensor)), None)
    return first is not None and first.device.type == "cuda"


def _decompose_on_cuda(name: str) -> Callable:
    def rule(mode: FunctionalTensorMode, op: Any, types: tuple[type, ...], args: tuple, kwargs: dict) -> Any:
        known = all(issubclass(t, (FakeTensor, FunctionalTensor)) or t is torch.Tensor for t in types)
        if not known or not _on_cuda(args):
            return mode.__torch_dispatch__(op, types, args, kwargs)
        with mode:
            return getattr(torch.ops.pagedserve_triton, name)(*args, **kwargs)
    return rule


def expose_to_inductor() -> None:
    """Register the triton_op twins and the CUDA decomposition rules (idempotent). Call it before the first
    `torch.compile` trace of a model that runs on a GPU."""
    global _exposed
    if _exposed:
        return
    for name, (custom_op, launcher, mutates) in _OPS.items():
        torch.library.triton_op(f"{NAMESPACE}::{name}", launcher, mutates_args=mutates)
        custom_op.register_torch_dispatch(FunctionalTensorMode, _decompose_on_cuda(name))
    _exposed = True
