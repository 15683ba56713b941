"""Dense Qwen2 / Qwen3 / Llama decoders over a flat token batch and a paged K/V cache.

The three families differ only by flags in ModelConfig: q/k/v bias (Qwen2, optional for Llama),
per-head q/k RMSNorm (Qwen3) and tied embeddings. Q/K/V and gate/up projections are fused at load
so each layer runs three GEMMs plus the output projection. Linear weights are dense or quantized
(engine/models/linear.py); so is the embedding table (LinearLoader.embedding_and_head).
"""
from __future__ import annotations

import torch

import ops
from engine.loading.model_config import ModelConfig
from engine.models.batch import ForwardBatch
from engine.models.linear import LinearLoader, embedding, linear, weight_nbytes
from ops.rotary import rope_cos_sin, rotary_mean

pagedserve = ops.direct
# Keys are stored less the k_proj bias's mean rotation over this many positions (DenseDecoder.__init__):
# most keys sit in the first few thousand, and the low-frequency pairs that carry large biases turn little
# even well past them.
KEY_OFFSET_POSITIONS = 8192


class _Layer:
    __slots__ = ("ln1", "ln2", "qkv_w", "qkv_b", "q_norm", "k_norm", "o_w", "gate_up_w", "down_w",
                 "k_offset")


class DenseDecoder:
    def __init__(self, cfg: ModelConfig, ckpt, dtype: torch.dtype, device: torch.device,
                 linears: LinearLoader | None = None):
        self.cfg = cfg
        self.dtype = dtype
        self.device = device
        h, d = cfg.hidden_size, cfg.head_dim
        self.q_size, self.kv_size = cfg.num_heads * d, cfg.num_kv_heads * d
        self.scale = d ** -0.5

        self.linears = linears = linears or LinearLoader(ckpt, dtype, device)

        def get(name, *shape):
            return ckpt.get(name, tuple(shape), dtype).to(device)

        self.norm = get("model.norm.weight", h)
        self.embed, self.lm_head = linears.embedding_and_head(cfg.vocab_size, h, cfg.tie_word_embeddings)
        self.layers = []
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            layer = _Layer()
            layer.ln1 = get(p + "input_layernorm.weight", h)
            layer.ln2 = get(p + "post_attention_layernorm.weight", h)
            attn = p + "self_attn."
            layer.qkv_w = linears.load([(attn + "q_proj.weight", self.q_size, h),
                                        (attn + "k_proj.weight", self.kv_size, h),
                                        (attn + "v_proj.weight", self.kv_size, h)])
            layer.qkv_b = (torch.cat([get(attn + "q_proj.bias", self.q_size),
                                      get(attn + "k_proj.bias", self.kv_size),
                                      get(attn + "v_proj.bias", self.kv_size)])
                           if cfg.qkv_bias else None)
            layer.q_norm = get(attn + "q_norm.weight", d) if cfg.qk_norm else None
            layer.k_norm = get(attn + "k_norm.weight", d) if cfg.qk_norm else None
            layer.o_w = linears.load([(attn + "o_proj.weight", h, self.q_size)])
            mlp = p + "mlp."
            inter = cfg.intermediate_size
            layer.gate_up_w = linears.load([(mlp + "gate_proj.weight", inter, h),
                                            (mlp + "up_proj.weight", inter, h)])
            layer.down_w = linears.load([(mlp + "down_proj.weight", h, inter)])
            self.layers.append(layer)
        self.cos_sin = rope_cos_sin(cfg.max_position_embeddings, cfg.rotary_dim,
                                    cfg.rope_theta, cfg.rope_params).to(device)
        # A large k_proj bias (Qwen2) gives a few channels of every key a large, nearly constant value (its
        # low-frequency rotary pairs barely turn): it sets their blocks' scales in a quantized cache, and
        # 4 bits then leave nothing of the rest. Subtracting one constant vector from every key moves each
        # query's scores by one constant, which the softmax drops, so every cache (whatever its dtype)
        # stores keys less the bias's mean rotation. After a k norm the bias is no constant part of the
        # keys, so those models store keys as they are.
        offsets = self.cos_sin[:KEY_OFFSET_POSITIONS]
        for layer in self.layers:
            bias = (layer.qkv_b[self.q_size:self.q_size + self.kv_size].view(cfg.num_kv_heads, d)
                    if layer.qkv_b is not None and layer.k_norm is None else None)
            layer.k_offset = None if bias is None else rotary_mean(bias, offsets, cfg.rotary_dim).to(dtype)

    @property
    def num_kv_layers(self) -> int:
        return self.cfg.num_layers

    state_shape = None      # no recurrent layers

    @property
    def weight_bytes(self) -> int:
        tensors = [self.embed, self.norm] + ([] if self.lm_head is self.embed else [self.lm_head])
        for layer in self.layers:
            tensors += [t for t in (getattr(layer, s) for s in _Layer.__slots__) if t is not None]
        return sum(map(weight_nbytes, tensors))

    def _attention(self, layer: _Layer, x: torch.Tensor, batch: ForwardBatch, kv) -> torch.Tensor:
        cfg = self.cfg
        t = x.shape[0]
        qkv = linear(x, layer.qkv_w, layer.qkv_b)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(t, cfg.num_heads, cfg.head_dim)
        k = k.reshape(t, cfg.num_kv_heads, cfg.head_dim)
        v = v.reshape(t, cfg.num_kv_heads, cfg.head_dim)
        if layer.q_norm is not None:
            q = pagedserve.rms_norm(q, layer.q_norm, cfg.rms_norm_eps)
            k = pagedserve.rms_norm(k, layer.k_norm, cfg.rms_norm_eps)
        q, k = pagedserve.rotary(q, k, batch.positions, self.cos_sin, cfg.rotary_dim)
        if layer.k_offset is not None:
            k = k - layer.k_offset
        k_cache, v_cache = kv
        pagedserve.write_kv(k_cache, v_cache, k, v, batch.slot_mapping)
        o = pagedserve.paged_attention(q, k_cache, v_cache, batch.query_start_loc,
                                       batch.context_lens, batch.block_tables, self.scale)
        return linear(o.reshape(t, self.q_size), layer.o_w)

    def forward(self, batch: ForwardBatch, kv_layers) -> torch.Tensor:
        """Hidden states of the sampling rows' last tokens, `[S, hidden]`."""
        eps = self.cfg.rms_norm_eps
        x = embedding(batch.input_ids, self.embed, self.dtype)
        residual = x
        h = pagedserve.rms_norm(x, self.layers[0].ln1, eps)
        for i, layer in enumerate(self.layers):
            if i:
                h, residual = pagedserve.add_rms_norm(x, residual, layer.ln1, eps)
            x = self._attention(layer, h, batch, kv_layers[i])
            h, residual = pagedserve.add_rms_norm(x, residual, layer.ln2, eps)
            x = linear(pagedserve.silu_and_mul(linear(h, layer.gate_up_w)), layer.down_w)
        # only the sampling rows need the final norm and the vocabulary projection
        x, residual = x[batch.logits_indices], residual[batch.logits_indices]
        h, _ = pagedserve.add_rms_norm(x, residual, self.norm, eps)
        return h

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return linear(hidden, self.lm_head).float()
