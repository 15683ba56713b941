"""The one model interface the builder and the runner use, whatever the architecture, and the choice
of class for a config. Dense models keep no recurrent state (`state_shape` None, no state args)."""
from __future__ import annotations

from typing import Protocol

import torch

from engine.kv.pool import StateShape
from engine.loading.model_config import ModelConfig
from engine.models.batch import ForwardBatch
from engine.models.linear import LinearLoader


class DecoderModel(Protocol):
    cfg: ModelConfig
    linears: LinearLoader           # every projection's weights, described by `linears.describe()`

    @property
    def num_kv_layers(self) -> int: ...

    @property
    def state_shape(self) -> StateShape | None: ...

    @property
    def weight_bytes(self) -> int: ...

    def forward(self, batch: ForwardBatch, kv_layers, *state) -> torch.Tensor:
        """Hidden states of the sampling rows; `state` = (state_layers, state_slots) when
        `state_shape` is not None."""

    def logits(self, hidden: torch.Tensor) -> torch.Tensor: ...


def build_decoder(cfg: ModelConfig, ckpt, dtype: torch.dtype, device: torch.device,
                  linears: LinearLoader) -> DecoderModel:
    from engine.models.qwen3 import DenseDecoder
    from engine.models.qwen3_5 import HybridDecoder

    return (HybridDecoder if cfg.is_hybrid else DenseDecoder)(cfg, ckpt, dtype, device, linears)
