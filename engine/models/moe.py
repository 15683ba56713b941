"""The MLP of a hybrid / MoE decoder layer: dense SwiGLU, or sparse experts (+ a gated shared expert).

Qwen3-MoE, Qwen3-Next and Qwen3.5-MoE share this block; per-expert checkpoint tensors
(`experts.{e}.gate_proj` ...) and the fused `experts.gate_up_proj` / `experts.down_proj` layout are both read.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

import ops
from ops import pointwise
from engine.loading.model_config import ModelConfig
from engine.models.linear import LinearLoader, linear

pagedserve = ops.direct


def _swiglu(prefix: str, hidden: int, inter: int) -> tuple[list, list]:
    """The LinearLoader parts of one SwiGLU MLP: (gate rows then up rows [2I, H], down [H, I])."""
    return ([(prefix + "gate_proj.weight", inter, hidden), (prefix + "up_proj.weight", inter, hidden)],
            [(prefix + "down_proj.weight", hidden, inter)])


class MLP:
    def __init__(self, cfg: ModelConfig, get, names: set[str], prefix: str, sparse: bool,
                 linears: LinearLoader):
        h = cfg.hidden_size
        self.sparse = sparse
        self.tensors: list[torch.Tensor] = []
        if not sparse:
            self.gate_up, self.down = map(linears.assemble, _swiglu(prefix, h, cfg.intermediate_size))
            self.tensors += [self.gate_up, self.down]
            return
        experts, inter = cfg.num_experts, cfg.moe_intermediate_size
        self.top_k, self.normalize = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.router = get(prefix + "gate.weight", experts, h)
        fused = prefix + "experts.gate_up_proj"
        if any(n == fused or n.endswith("." + fused.removeprefix("model.")) for n in names):
            self.gate_up = get(fused, experts, 2 * inter, h)
            self.down = get(prefix + "experts.down_proj", experts, h, inter)
        else:
            def dense(parts: list) -> torch.Tensor:
                return torch.cat([get(*part) for part in parts])
            pairs = [_swiglu(f"{prefix}experts.{e}.", h, inter) for e in range(experts)]
            self.gate_up = torch.stack([dense(p[0]) for p in pairs])
            self.down = torch.stack([dense(p[1]) for p in pairs])
        self.tensors += [self.router, self.gate_up, self.down]
        self.shared = None
        if cfg.shared_expert_intermediate_size:
            gate_up, down = map(linears.assemble, _swiglu(prefix + "shared_expert.", h,
                                                          cfg.shared_expert_intermediate_size))
            self.shared = (gate_up, down, get(prefix + "shared_expert_gate.weight", 1, h))
            self.tensors += list(self.shared)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not self.sparse:
            return linear(pagedserve.silu_and_mul(linear(x, self.gate_up)), self.down)
        weights, ids = pagedserve.moe_route(F.linear(x, self.router), self.top_k, self.normalize)
        out = pagedserve.moe_experts(x, self.gate_up, self.down, weights, ids)
        if self.shared is not None:
            gate_up, down, gate = self.shared
            shared = linear(pagedserve.silu_and_mul(linear(x, gate_up)), down)
            out = out + pointwise.sigmoid(F.linear(x, gate)) * shared
        return out
