"""The full-attention layer of hybrid / MoE decoders: Qwen3-style q/k RMSNorm, partial rotary, paged K/V,
and (Qwen3-Next / Qwen3.5) a per-channel sigmoid output gate emitted by q_proj next to each query head."""
from __future__ import annotations

import torch

import ops
from ops import pointwise
from engine.loading.model_config import ModelConfig
from engine.models.linear import LinearLoader, linear
from engine.models.batch import ForwardBatch

pagedserve = ops.direct


class GatedAttention:
    def __init__(self, cfg: ModelConfig, get, norm, prefix: str, linears: LinearLoader):
        self.cfg = cfg
        h, d, heads = cfg.hidden_size, cfg.head_dim, cfg.num_heads
        self.q_size, self.kv_size = heads * d, cfg.num_kv_heads * d
        self.gate_size = self.q_size if cfg.gated_attention else 0
        self.scale = d ** -0.5

        # the checkpoint's q_proj interleaves query and gate rows per head (query d, gate d): the fused
        # projection takes [queries, k, v, gates], each part as rows picked from a stored tensor
        q_out = self.q_size + self.gate_size
        query, *gate = (half.reshape(-1) for half in torch.arange(q_out).view(heads, -1, d).unbind(1))
        parts = [(prefix + "q_proj.", q_out, query), (prefix + "k_proj.", self.kv_size, None),
                 (prefix + "v_proj.", self.kv_size, None), *((prefix + "q_proj.", q_out, g) for g in gate)]

        def bias(module: str, n: int, rows: torch.Tensor | None) -> torch.Tensor:
            b = get(module + "bias", n)
            return b if rows is None else b[rows]
        self.qkvg_w = linears.assemble([(module + "weight", n, h, rows) for module, n, rows in parts])
        self.qkvg_b = torch.cat([bias(*part) for part in parts]) if cfg.qkv_bias else None
        self.q_norm, self.k_norm = norm(prefix + "q_norm.weight", d), norm(prefix + "k_norm.weight", d)
        self.o_w = linears.assemble([(prefix + "o_proj.weight", h, self.q_size)])
        self.tensors = [t for t in (self.qkvg_w, self.qkvg_b, self.q_norm, self.k_norm, self.o_w) if t is not None]

    def __call__(self, x: torch.Tensor, batch: ForwardBatch, kv, cos_sin: torch.Tensor) -> torch.Tensor:
        cfg, t = self.cfg, x.shape[0]
        qkvg = linear(x, self.qkvg_w, self.qkvg_b)
        q, k, v, gate = qkvg.split([self.q_size, self.kv_size, self.kv_size, self.gate_size], dim=-1)
        q = pagedserve.rms_norm(q.reshape(t, cfg.num_heads, cfg.head_dim), self.q_norm, cfg.rms_norm_eps)
        k = pagedserve.rms_norm(k.reshape(t, cfg.num_kv_heads, cfg.head_dim), self.k_norm, cfg.rms_norm_eps)
        v = v.reshape(t, cfg.num_kv_heads, cfg.head_dim)
        q, k = pagedserve.rotary(q, k, batch.positions, cos_sin, cfg.rotary_dim)
        k_cache, v_cache = kv
        pagedserve.write_kv(k_cache, v_cache, k, v, batch.slot_mapping)
        o = pagedserve.paged_attention(q, k_cache, v_cache, batch.query_start_loc, batch.context_lens,
                                       batch.block_tables, self.scale).reshape(t, self.q_size)
        if self.gate_size:
            o = o * pointwise.sigmoid(gate)
        return linear(o, self.o_w)
