"""Speculative decoding on hybrid models: a verify row's recurrent state rolled back to its kept tokens.

A verify row (last token, p1..pk) leaves its state slot at the state after all 1 + k tokens. Its
linear-attention ops also record the state after each of its tokens into per-layer scratch buffers
(`checkpoints` of ops causal_conv1d / gated_delta_rule). After sampling the request keeps 1 + m
draws, `engine.speculation.accepted_run` (the rule the scheduler applies to the same result), so its
computed positions end after row position m; when m < k, checkpoint m replaces the slot's state in
every layer. Everything that reads the slot later (the next row, a prefix-cache checkpoint copied
by the next plan's state ops) sees the state of exactly the kept tokens.
"""
from __future__ import annotations

import torch

from engine.contracts import Draw, PlanRow, RowOutput
from engine.models.batch import ForwardBatch
from engine.speculation import accepted_run


class StateRollback:
    """The scratch buffers and the rollback; inert for models without recurrent state. The buffers grow
    to the largest step's recording tokens, rounded up to a power of two but not past `capacity` (the
    most a step carries), and are kept: their contents matter only within a step. Grown on demand, not
    sized from the limits up front: a GPU's verify budget times one state per token would not fit."""

    def __init__(self, state_pool, capacity: int) -> None:
        self.state_pool = state_pool          # engine.kv.pool.StatePool, or None
        self.capacity = capacity
        self._buffers: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._recording: list[tuple[PlanRow, int]] = []     # this step's rows and their first checkpoint

    def prepare(self, batch: ForwardBatch, rows: list[PlanRow]) -> None:
        """Give the step's verify rows that hold a state slot checkpoint ranges in `batch`."""
        self._recording, first, total = [], [], 0
        if self.state_pool is not None:
            for row in rows:
                recording = row.num_draft > 0 and row.state_slot is not None
                first.append(total if recording else -1)
                if recording:
                    self._recording.append((row, total))
                    total += len(row.token_ids)
        if not self._recording:
            return
        batch.checkpoint_start = torch.tensor(first, dtype=torch.int32).to(batch.input_ids.device)
        batch.state_checkpoints = self._reserve(total)

    @property
    def recording(self) -> bool:
        """Rows of this step await `apply` (which needs their draws on the host)."""
        return bool(self._recording)

    def apply(self, draws: dict[str, list[tuple]]) -> None:
        """After sampling (`draws`: each row's (token, logprob, top) draws in order): every recording row
        whose run stops before its last proposal gets the state after its last kept token."""
        dst, src = [], []
        for row, first in self._recording:
            (token, *_), *verify = draws[row.request_id]
            kept = len(accepted_run(row, RowOutput(row.request_id, token=token,
                                                   verify=tuple(Draw(d[0]) for d in verify))))
            if kept <= row.num_draft:
                dst.append(row.state_slot)
                src.append(first + kept - 1)
        self._recording = []
        if not dst:
            return
        device = self._buffers[0][0].device
        dst_t, src_t = (torch.tensor(v, dtype=torch.long, device=device) for v in (dst, src))
        for (conv, ssm), (conv_ck, ssm_ck) in zip(self.state_pool.layers, self._buffers):
            conv.index_copy_(0, dst_t, conv_ck.index_select(0, src_t))
            ssm.index_copy_(0, dst_t, ssm_ck.index_select(0, src_t))

    def _reserve(self, tokens: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        if not self._buffers or self._buffers[0][0].shape[0] < tokens:
            size = max(tokens, min(self.capacity, 1 << (tokens - 1).bit_length()))
            self._buffers = [(conv.new_empty((size, *conv.shape[1:])), ssm.new_empty((size, *ssm.shape[1:])))
                             for conv, ssm in self.state_pool.layers]
        return self._buffers
