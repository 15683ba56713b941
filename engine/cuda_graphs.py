"""CUDA graphs for decode-only steps: one captured forward per (bucketed batch size, block-table width, buffers).

A decode step at B rows is padded up to the next bucket: padding rows have zero new tokens, context 0, slot
-1 for K/V and recurrent state, so every op skips them (see ops/*: "padding rows touch nothing"), and their
tokens sit past query_start_loc[-1], whose outputs are zeros. The step's tensors are copied into the
graph's static input buffers in place (StaticInputs: no per-step allocation) and the graph is replayed. A graph bakes in the addresses of everything it
touches, so its key holds every buffer that can differ between replays: the bucket, the table width, and
the identity (data pointer, shape, dtype) of each external tensor passed in (K/V cache layers, state pools).
If the pool is reallocated, the old graphs are simply never hit again.

The forward captured must not read tensors on the host (no .item()/.tolist()); pagedserve's Triton kernels
never do. Prefill and mixed steps run eagerly (`graph_key` returns None for them).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import Tensor

from engine.models.batch import ForwardBatch

BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


@dataclass(frozen=True)
class GraphKey:
    rows: int                                      # bucketed decode rows (= tokens)
    table_width: int                               # block_tables columns, bucketed to a power of two
    buffers: tuple[tuple[int, tuple[int, ...], torch.dtype], ...]   # the external tensors' identities
    with_state: bool                               # hybrid models pass per-row state slots


def _bucket(n: int, buckets: tuple[int, ...]) -> int | None:
    return next((b for b in buckets if b >= n), None)


def _flat_tensors(value: Any) -> list[Tensor]:
    if isinstance(value, Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _flat_tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _flat_tensors(v)]
    return [t for name in getattr(value, "__dataclass_fields__", {}) for t in _flat_tensors(getattr(value, name))]


def graph_key(batch: ForwardBatch, external: tuple[Any, ...], with_state: bool = False,
              buckets: tuple[int, ...] = BATCH_BUCKETS) -> GraphKey | None:
    """The graph a decode-only batch replays, or None when it must run eagerly (prefill rows, too many rows)."""
    rows, tokens = batch.context_lens.shape[0], batch.input_ids.shape[0]
    bucket = _bucket(rows, buckets)
    if bucket is None or tokens != rows or batch.logits_indices.shape[0] != rows:
        return None
    width = 1 << max(0, batch.block_tables.shape[1] - 1).bit_length()
    identities = tuple((t.data_ptr(), tuple(t.shape), t.dtype) for t in _flat_tensors(external))
    return GraphKey(bucket, width, identities, with_state)


class StaticInputs:
    """A graph's input buffers, allocated once for (rows, table_width) and loaded in place each step:
    the step's R decode rows first, then padding rows that touch nothing (no new token: qsl stays at
    R; context 0; K/V and state slot -1; logits index 0). Nothing is allocated per step."""

    _FILL = {"input_ids": 0, "positions": 0, "slot_mapping": -1, "context_lens": 0, "logits_indices": 0}

    def __init__(self, like: ForwardBatch, rows: int, table_width: int, with_state: bool):
        def buffer(t: Tensor, shape: tuple[int, ...], fill: int) -> Tensor:
            return torch.full(shape, fill, dtype=t.dtype, device=t.device)
        self.batch = ForwardBatch(
            **{name: buffer(getattr(like, name), (rows,), fill) for name, fill in self._FILL.items()},
            query_start_loc=buffer(like.query_start_loc, (rows + 1,), 0),
            block_tables=buffer(like.block_tables, (rows, table_width), 0))
        self.state_slots = (torch.full((rows,), -1, dtype=torch.int32, device=like.input_ids.device)
                            if with_state else None)

    def load(self, batch: ForwardBatch, state_slots: Tensor | None = None) -> ForwardBatch:
        real, width = batch.context_lens.shape[0], batch.block_tables.shape[1]
        dst = self.batch
        for name, fill in self._FILL.items():
            getattr(dst, name)[:real].copy_(getattr(batch, name), non_blocking=True)
            getattr(dst, name)[real:].fill_(fill)
        dst.query_start_loc[:real + 1].copy_(batch.query_start_loc, non_blocking=True)
        dst.query_start_loc[real + 1:].fill_(real)
        dst.block_tables[:real, :width].copy_(batch.block_tables, non_blocking=True)
        dst.block_tables[:real, width:].zero_()
        dst.block_tables[real:].zero_()
        if self.state_slots is not None:
            self.state_slots[:real].copy_(state_slots, non_blocking=True)
            self.state_slots[real:].fill_(-1)
        return dst


class _Graph:
    """Static input buffers and the graph captured on them. Warm-up and capture run on a batch of padding
    rows only (slots -1, no tokens), so they write no K/V and advance no recurrent state: a real step runs
    only through `replay`."""

    def __init__(self, forward: Callable[..., Tensor], inputs: StaticInputs, external: tuple[Any, ...],
                 warmups: int, pool: Any):
        self.inputs = inputs
        args = external if inputs.state_slots is None else (*external, inputs.state_slots)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(warmups):   # lets torch.compile / Triton autotuning finish outside the capture
                forward(inputs.batch, *args)
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.output = forward(inputs.batch, *args)

    def replay(self, batch: ForwardBatch, state_slots: Tensor | None) -> Tensor:
        self.inputs.load(batch, state_slots)
        self.graph.replay()
        return self.output


class DecodeGraphs:
    """Replays `forward(batch, *external[, state_slots])` (the model's forward) from CUDA graphs for
    decode-only batches; captures a graph the first time a key is seen. `run` returns None when the batch
    must run eagerly. The returned hidden states are the graph's output buffer (rows beyond the batch's
    are padding): read or copy them before the next replay."""

    def __init__(self, forward: Callable[..., Tensor], *, buckets: tuple[int, ...] = BATCH_BUCKETS,
                 warmups: int = 2):
        self.forward, self.buckets, self.warmups = forward, buckets, warmups
        self.graphs: dict[GraphKey, _Graph] = {}
        self.pool = None                           # one memory pool shared by every captured graph

    def run(self, batch: ForwardBatch, *external: Any, state_slots: Tensor | None = None) -> Tensor | None:
        key = graph_key(batch, external, state_slots is not None, self.buckets)
        if key is None or batch.input_ids.device.type != "cuda":
            return None
        graph = self.graphs.get(key)
        if graph is None:
            if self.pool is None:
                self.pool = torch.cuda.graph_pool_handle()
            inputs = StaticInputs(batch, key.rows, key.table_width, key.with_state)
            graph = self.graphs[key] = _Graph(self.forward, inputs, external, self.warmups, self.pool)
        return graph.replay(batch, state_slots)[:batch.input_ids.shape[0]]
