"""The linear-attention (Gated DeltaNet) layer of Qwen3-Next / Qwen3.5, over a flat batch with state slots.

All input projections run as one GEMM. Qwen3-Next's fused `in_proj_qkvz` / `in_proj_ba` interleave the
projections per key-head group; their rows are reordered at load (dense or in group form) into Qwen3.5's
split layout (all q, all k, all v, all z, then b, a), so one forward serves both.
"""
from __future__ import annotations

import torch

import ops
from ops import pointwise
from engine.kv.pool import StateShape
from engine.loading.model_config import ModelConfig
from engine.models.linear import LinearLoader, linear
from engine.models.batch import ForwardBatch

pagedserve = ops.direct


def state_shape(cfg: ModelConfig, dtype: torch.dtype) -> StateShape:
    key_dim = cfg.linear_num_key_heads * cfg.linear_key_head_dim
    value_dim = cfg.linear_num_value_heads * cfg.linear_value_head_dim
    return StateShape(len(cfg.linear_layers), 2 * key_dim + value_dim, cfg.linear_conv_kernel_dim - 1,
                      cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim, dtype)


class GatedDeltaNet:
    def __init__(self, cfg: ModelConfig, get, prefix: str, linears: LinearLoader):
        self.cfg = cfg
        h = cfg.hidden_size
        hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.key_dim, self.value_dim, self.v_heads = hk * dk, hv * dv, hv
        self.conv_dim = 2 * self.key_dim + self.value_dim
        if cfg.fused_linear_proj:
            # per key head: [q, k, v, z] rows in in_proj_qkvz and [b, a] rows in in_proj_ba
            group = hv // hk
            qkvz = torch.arange(self.conv_dim + self.value_dim).view(hk, -1).split([dk, dk, group * dv, group * dv], 1)
            ba = torch.arange(2 * hv).view(hk, -1).split([group, group], 1)
            parts = [(prefix + "in_proj_qkvz.weight", self.conv_dim + self.value_dim, h,
                      torch.cat([rows.reshape(-1) for rows in qkvz])),
                     (prefix + "in_proj_ba.weight", 2 * hv, h, torch.cat([rows.reshape(-1) for rows in ba]))]
        else:
            parts = [(prefix + "in_proj_qkv.weight", self.conv_dim, h),
                     (prefix + "in_proj_z.weight", self.value_dim, h),
                     (prefix + "in_proj_b.weight", hv, h), (prefix + "in_proj_a.weight", hv, h)]
        self.in_w = linears.assemble(parts)
        kernel = cfg.linear_conv_kernel_dim
        self.conv_w = get(prefix + "conv1d.weight", self.conv_dim, 1, kernel).reshape(self.conv_dim, kernel)
        # HF adds dt_bias (in the model dtype) to fp32 inputs: round through the dtype, keep fp32
        self.dt_bias = get(prefix + "dt_bias", hv).float()
        self.neg_a = -get(prefix + "A_log", hv).float().exp()
        self.norm_w = get(prefix + "norm.weight", dv)
        self.out_w = linears.assemble([(prefix + "out_proj.weight", h, self.value_dim)])
        self.tensors = [self.in_w, self.conv_w, self.dt_bias, self.neg_a, self.norm_w, self.out_w]

    def __call__(self, x: torch.Tensor, batch: ForwardBatch, state, state_slots: torch.Tensor,
                 checkpoints=None) -> torch.Tensor:
        """`checkpoints`: this layer's (conv, ssm) scratch where `batch.checkpoint_start` rows record their
        state after each token, or None."""
        cfg, t = self.cfg, x.shape[0]
        conv_state, ssm_state = state
        conv_ck, ssm_ck = checkpoints or (None, None)
        qkv, z, b, a = linear(x, self.in_w).split([self.conv_dim, self.value_dim, self.v_heads, self.v_heads], -1)
        qkv = pagedserve.causal_conv1d(qkv.contiguous(), self.conv_w, conv_state, batch.query_start_loc,
                                       state_slots, True, conv_ck, batch.checkpoint_start)
        q, k, v = qkv.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = q.reshape(t, cfg.linear_num_key_heads, cfg.linear_key_head_dim)
        k = k.reshape(t, cfg.linear_num_key_heads, cfg.linear_key_head_dim)
        v = v.reshape(t, self.v_heads, cfg.linear_value_head_dim)
        decay = self.neg_a * pointwise.softplus(a.float() + self.dt_bias)
        o = pagedserve.gated_delta_rule(q, k, v, decay, pointwise.sigmoid(b), ssm_state, batch.query_start_loc,
                                        state_slots, True, ssm_ck, batch.checkpoint_start)
        # gated RMSNorm: scale the normalised output by silu(z), in fp32, per value head
        o = pagedserve.rms_norm(o, self.norm_w, cfg.rms_norm_eps)
        o = (o * pointwise.silu(z.reshape(t, self.v_heads, -1).float())).to(x.dtype)
        return linear(o.reshape(t, self.value_dim), self.out_w)
