"""`pagedserve::moe_route` and `pagedserve::moe_experts`: a sparse mixture-of-experts MLP over a flat batch.

`moe_route` turns router logits into each token's top-k experts and weights (softmax in fp32, top-k,
optionally renormalised to sum to 1, weights cast back to the logits' dtype, as Qwen3-MoE/Next/3.5 do).
`moe_experts` runs each expert's SwiGLU MLP on the tokens routed to it and sums the weighted outputs.
The shared expert and its sigmoid gate are plain dense layers and live in the model.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ops import pointwise
from ops._registry import NAMESPACE, impl, register, require


def _check_route(router_logits: Tensor, top_k: int) -> None:
    require(router_logits.dim() == 2 and 1 <= top_k <= router_logits.shape[1], "moe_route",
            f"router_logits must be [T, E] with 1 <= top_k <= E, got {tuple(router_logits.shape)}, top_k={top_k}")


def _check_experts(x: Tensor, gate_up: Tensor, down: Tensor, weights: Tensor, ids: Tensor) -> None:
    op = "moe_experts"
    require(x.dim() == 2, op, f"x must be [T, H], got {tuple(x.shape)}")
    t, hidden = x.shape
    require(gate_up.dim() == 3 and gate_up.shape[2] == hidden and gate_up.shape[1] % 2 == 0, op,
            f"gate_up must be [E, 2*I, H={hidden}] (gate rows then up rows), got {tuple(gate_up.shape)}")
    experts, inter = gate_up.shape[0], gate_up.shape[1] // 2
    require(down.shape == (experts, hidden, inter), op,
            f"down must be [E={experts}, H={hidden}, I={inter}], got {tuple(down.shape)}")
    require(ids.dim() == 2 and ids.shape[0] == t and ids.dtype == torch.int64 and weights.shape == ids.shape, op,
            f"ids must be int64 [T={t}, k] and weights the same shape, got ids {ids.dtype} {tuple(ids.shape)}, "
            f"weights {tuple(weights.shape)}")
    require(x.dtype == gate_up.dtype == down.dtype, op,
            f"x, gate_up and down must share a dtype, got {x.dtype}, {gate_up.dtype}, {down.dtype}")


def reference_moe_route(router_logits: Tensor, top_k: int, normalize: bool) -> tuple[Tensor, Tensor]:
    weights, ids = [], []
    for row in router_logits.float():
        probs = torch.exp(row - row.max())
        probs = probs / probs.sum()
        order = sorted(range(len(probs)), key=lambda e: (-float(probs[e]), e))[:top_k]
        picked = probs[order]
        weights.append(picked / picked.sum() if normalize else picked)
        ids.append(order)
    return torch.stack(weights).to(router_logits.dtype), torch.tensor(ids, dtype=torch.int64)


def reference_moe_experts(x: Tensor, gate_up: Tensor, down: Tensor, weights: Tensor, ids: Tensor) -> Tensor:
    inter = gate_up.shape[1] // 2
    out = torch.zeros(x.shape, dtype=torch.float32)
    for t in range(x.shape[0]):
        for slot in range(ids.shape[1]):
            e = int(ids[t, slot])
            h = gate_up[e].float() @ x[t].float()
            act = h[:inter] * torch.sigmoid(h[:inter]) * h[inter:]
            out[t] += float(weights[t, slot]) * (down[e].float() @ act)
    return out.to(x.dtype)


@register("moe_route", "cpu")
def torch_moe_route(router_logits: Tensor, top_k: int, normalize: bool) -> tuple[Tensor, Tensor]:
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(router_logits.dtype), ids


@register("moe_experts", "cpu")
def torch_moe_experts(x: Tensor, gate_up: Tensor, down: Tensor, weights: Tensor, ids: Tensor) -> Tensor:
    out = torch.zeros_like(x)
    flat = ids.flatten()
    order = flat.argsort(stable=True)
    counts = torch.bincount(flat, minlength=gate_up.shape[0]).tolist()
    token_of = order // ids.shape[1]
    weight_of = weights.flatten().index_select(0, order)
    start = 0
    for expert, count in enumerate(counts):       # only experts some token picked cost a GEMM
        if not count:
            continue
        tokens = token_of[start:start + count]
        h = F.linear(x.index_select(0, tokens), gate_up[expert])
        inter = h.shape[-1] // 2
        y = F.linear(pointwise.silu(h[:, :inter]) * h[:, inter:], down[expert])
        out.index_add_(0, tokens, y * weight_of[start:start + count, None].to(y.dtype))
        start += count
    return out


@torch.library.custom_op(f"{NAMESPACE}::moe_route", mutates_args=())
def moe_route(router_logits: Tensor, top_k: int, normalize: bool) -> tuple[Tensor, Tensor]:
    _check_route(router_logits, top_k)
    return impl("moe_route", router_logits.device)(router_logits, top_k, normalize)


@moe_route.register_fake
def _(router_logits: Tensor, top_k: int, normalize: bool) -> tuple[Tensor, Tensor]:
    _check_route(router_logits, top_k)
    shape = (router_logits.shape[0], top_k)
    return router_logits.new_empty(shape), router_logits.new_empty(shape, dtype=torch.int64)


@torch.library.custom_op(f"{NAMESPACE}::moe_experts", mutates_args=())
def moe_experts(x: Tensor, gate_up: Tensor, down: Tensor, weights: Tensor, ids: Tensor) -> Tensor:
    _check_experts(x, gate_up, down, weights, ids)
    return impl("moe_experts", x.device)(x, gate_up, down, weights, ids)


@moe_experts.register_fake
def _(x: Tensor, gate_up: Tensor, down: Tensor, weights: Tensor, ids: Tensor) -> Tensor:
    _check_experts(x, gate_up, down, weights, ids)
    return torch.empty_like(x)
