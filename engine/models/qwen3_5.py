"""Hybrid and MoE decoders over a flat token batch: Qwen3.5 / Qwen3.5-MoE / Qwen3-Next (Gated DeltaNet
linear-attention layers interleaved with gated full-attention layers) and Qwen3-MoE (full attention only).

Full-attention layers use the paged K/V cache (`kv_layers`, one entry per full-attention layer, in order);
linear-attention layers read and write their request's recurrent-state slot (`state_layers`, one (conv, ssm)
pair per linear-attention layer; `state_slots` int32 [B], -1 = no state). Zero-centred RMSNorm weights
(Qwen3-Next / Qwen3.5 scale by 1 + weight) are folded to `1 + weight` at load so the plain norm op serves.
"""
from __future__ import annotations

import torch

import ops
from engine.kv.pool import StateShape
from engine.loading.model_config import ModelConfig
from engine.models.batch import ForwardBatch
from engine.models.gated_attention import GatedAttention
from engine.models.gated_deltanet import GatedDeltaNet, state_shape
from engine.models.linear import LinearLoader, embedding, linear, weight_nbytes
from engine.models.moe import MLP
from ops.rotary import rope_cos_sin

pagedserve = ops.direct


class _Layer:
    __slots__ = ("ln1", "ln2", "attention", "linear", "mlp", "cache_index")


class HybridDecoder:
    def __init__(self, cfg: ModelConfig, ckpt, dtype: torch.dtype, device: torch.device,
                 linears: LinearLoader | None = None):
        self.cfg = cfg
        # the projections go through the same linear path (and formats) as the dense models'
        self.linears = linears = linears or LinearLoader(ckpt, dtype, device)
        self.dtype = dtype
        self.device = device
        h = cfg.hidden_size
        names = ckpt.names()

        def get(name, *shape):
            return ckpt.get(name, tuple(shape), dtype).to(device)

        def norm(name, size):
            if not cfg.zero_centred_norm:
                return get(name, size)
            return (1.0 + ckpt.get(name, (size,), torch.float32)).to(dtype).to(device)

        self.embed, self.lm_head = linears.embedding_and_head(cfg.vocab_size, h, cfg.tie_word_embeddings)
        self.norm = norm("model.norm.weight", h)
        attention_layers, linear_layers = cfg.attention_layers, cfg.linear_layers
        self.layers = []
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            layer = _Layer()
            layer.ln1 = norm(p + "input_layernorm.weight", h)
            layer.ln2 = norm(p + "post_attention_layernorm.weight", h)
            if i in attention_layers:
                layer.attention, layer.linear = GatedAttention(cfg, get, norm, p + "self_attn.", linears), None
                layer.cache_index = attention_layers.index(i)
            else:
                layer.attention, layer.linear = None, GatedDeltaNet(cfg, get, p + "linear_attn.", linears)
                layer.cache_index = linear_layers.index(i)
            layer.mlp = MLP(cfg, get, names, p + "mlp.", sparse=bool(cfg.moe_layers and cfg.moe_layers[i]),
                            linears=linears)
            self.layers.append(layer)
        self.cos_sin = rope_cos_sin(cfg.max_position_embeddings, cfg.rotary_dim, cfg.rope_theta,
                                    cfg.rope_params).to(device)

    @property
    def num_kv_layers(self) -> int:
        return len(self.cfg.attention_layers)

    @property
    def state_shape(self) -> StateShape | None:
        """Per-slot recurrent state of the linear-attention layers; None when there are none."""
        return state_shape(self.cfg, self.dtype) if self.cfg.linear_layers else None

    @property
    def weight_bytes(self) -> int:
        tensors = [self.embed, self.norm] + ([] if self.lm_head is self.embed else [self.lm_head])
        for layer in self.layers:
            mixer = layer.attention or layer.linear
            tensors += [layer.ln1, layer.ln2, *mixer.tensors, *layer.mlp.tensors]
        return sum(map(weight_nbytes, tensors))

    def forward(self, batch: ForwardBatch, kv_layers, state_layers=(), state_slots: torch.Tensor | None = None
                ) -> torch.Tensor:
        """Hidden states of the sampling rows' last tokens, `[S, hidden]`."""
        eps = self.cfg.rms_norm_eps
        if state_slots is None and self.cfg.linear_layers:
            raise ValueError("this model has linear-attention layers: pass state_layers and state_slots")
        x = embedding(batch.input_ids, self.embed, self.dtype)
        residual = x
        h = pagedserve.rms_norm(x, self.layers[0].ln1, eps)
        checkpoints = batch.state_checkpoints
        for i, layer in enumerate(self.layers):
            if i:
                h, residual = pagedserve.add_rms_norm(x, residual, layer.ln1, eps)
            if layer.attention is not None:
                x = layer.attention(h, batch, kv_layers[layer.cache_index], self.cos_sin)
            else:
                x = layer.linear(h, batch, state_layers[layer.cache_index], state_slots,
                                 None if checkpoints is None else checkpoints[layer.cache_index])
            h, residual = pagedserve.add_rms_norm(x, residual, layer.ln2, eps)
            x = layer.mlp(h)
        # only the sampling rows need the final norm and the vocabulary projection
        x, residual = x[batch.logits_indices], residual[batch.logits_indices]
        h, _ = pagedserve.add_rms_norm(x, residual, self.norm, eps)
        return h

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return linear(hidden, self.lm_head).float()
