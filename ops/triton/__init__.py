"""Triton kernels for every pagedserve op on CUDA and ROCm (both are torch device "cuda").

`ops._registry.impl` imports this package on the first CUDA call, which registers each launcher as the op's
"cuda" body. To let inductor see the kernels inside a compiled model, call `expose_to_inductor()` before the
first `torch.compile` trace (the first CUDA call may come after it). Launchers can also be called directly,
e.g. on CPU tensors under TRITON_INTERPRET=1 in tests.
"""
from __future__ import annotations

from ops._registry import register
from ops.moe import torch_moe_experts, torch_moe_route
from ops.triton.causal_conv1d import causal_conv1d
from ops.triton.gated_delta_rule import gated_delta_rule
from ops.triton.inductor import expose_to_inductor
from ops.triton.paged_attention import paged_attention
from ops.triton.rms_norm import add_rms_norm, rms_norm
from ops.triton.rotary import rotary
from ops.triton.silu_and_mul import silu_and_mul
from ops.triton.write_kv import write_kv

KERNELS = {
    "paged_attention": paged_attention, "write_kv": write_kv, "rms_norm": rms_norm, "add_rms_norm": add_rms_norm,
    "rotary": rotary, "silu_and_mul": silu_and_mul, "gated_delta_rule": gated_delta_rule,
    "causal_conv1d": causal_conv1d,
}
for _name, _kernel in KERNELS.items():
    register(_name, "cuda")(_kernel)
# No Triton MoE kernels yet: the torch code runs on GPUs too (eagerly; it reads expert counts on the host,
# so MoE steps cannot be CUDA-graphed).
register("moe_route", "cuda")(torch_moe_route)
register("moe_experts", "cuda")(torch_moe_experts)

__all__ = ["KERNELS", "expose_to_inductor", *KERNELS]
