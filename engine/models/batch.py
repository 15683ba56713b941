"""The flat token batch one forward consumes: prefill chunks and decode rows together."""
from __future__ import annotations

from dataclasses import dataclass

import torch


def on_device(values, device: torch.device, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """Host values (a list or a CPU tensor) on `device` without waiting for the work queued there: a
    blocking copy would wait for the step in flight, which overlapped scheduling plans past."""
    t = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    return t.to(device, dtype=dtype, non_blocking=True)


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor        # int64 [T]
    positions: torch.Tensor        # int64 [T]
    slot_mapping: torch.Tensor     # int64 [T]: block * block_size + offset, -1 = padding
    block_tables: torch.Tensor     # int32 [B, max_blocks]
    query_start_loc: torch.Tensor  # int32 [B + 1]
    context_lens: torch.Tensor     # int32 [B]: cached prefix + this step's tokens
    logits_indices: torch.Tensor   # int64 [S]: flat index of each sampling row's last token
    # hybrid models' verify rows record their recurrent state after each token (engine/state_rollback.py)
    checkpoint_start: torch.Tensor | None = None     # int32 [B]: a row's first checkpoint, -1 = none
    state_checkpoints: list | None = None            # per linear-attention layer: (conv, ssm) scratch
