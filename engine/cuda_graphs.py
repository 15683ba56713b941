"""CUDA graphs for decode-only steps: one captured forward per (bucketed batch size, block-table width, buffers).

A decode step at B rows is padded up to the next bucket: padding rows have zero new tokens, context 0, slot
-1 for K/V and recurrent state, so every op skips them (see ops/*: "padding rows touch nothing"), and their
tokens sit past query_start_loc[-1], whose outputs are zeros. The step's tensors are copied into the
graph's static input buffers and the graph is replayed. A graph bakes in the addresses of everything it
touches, so its key holds every buffer that can differ between replays: the bucket, the table width, and
the identity (data pointer, shape, dtype) of each external tensor passed in (K/V cache layers, state pools).
If the pool is reallocated, the old graphs are simply never hit again.

The forward captured must not read tensors on the host (no .item()/.tolist()); pagedserve's Triton kernels
never do. Prefill and mixed steps run eagerly (`graph_key` returns None for them).
"""
from __future__ import annotations

from dataclasses import dataclass, fields
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


def pad_decode_batch(batch: ForwardBatch, rows: int, table_width: int) -> ForwardBatch:
    """`batch` (R decode rows) padded to `rows` rows and `table_width` table columns with rows that touch
    nothing: no new token (qsl stays at R), context 0, K/V slot -1, their logits index pointing at row 0."""
    real = batch.context_lens.shape[0]
    pad = rows - real

    def grow(t: Tensor, fill: int) -> Tensor:
        return torch.cat([t, t.new_full((pad, *t.shape[1:]), fill)])

    tables = batch.block_tables.new_zeros(rows, table_width)
    tables[:real, :batch.block_tables.shape[1]] = batch.block_tables
    return ForwardBatch(
        input_ids=grow(batch.input_ids, 0), positions=grow(batch.positions, 0),
        slot_mapping=grow(batch.slot_mapping, -1), block_tables=tables,
        query_start_loc=grow(batch.query_start_loc, real), context_lens=grow(batch.context_lens, 0),
        logits_indices=grow(batch.logits_indices, 0))


class _Graph:
    """Static input buffers and the graph captured on them. Warm-up and capture run on a batch of padding
    rows only (slots -1, no tokens), so they write no K/V and advance no recurrent state: a real step runs
    only through `replay`."""

    def __init__(self, forward: Callable[..., Tensor], shapes: ForwardBatch, external: tuple[Any, ...],
                 with_state: bool, warmups: int, pool: Any):
        neutral = {"slot_mapping": -1}
        self.inputs = ForwardBatch(**{f.name: torch.full_like(getattr(shapes, f.name), neutral.get(f.name, 0))
                                      for f in fields(ForwardBatch)})
        rows = shapes.context_lens.shape[0]
        self.state_slots = (torch.full((rows,), -1, dtype=torch.int32, device=shapes.input_ids.device)
                            if with_state else None)
        args = external if self.state_slots is None else (*external, self.state_slots)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(warmups):   # lets torch.compile / Triton autotuning finish outside the capture
                forward(self.inputs, *args)
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.output = forward(self.inputs, *args)

    def replay(self, batch: ForwardBatch, state_slots: Tensor | None) -> Tensor:
        for f in fields(ForwardBatch):
            getattr(self.inputs, f.name).copy_(getattr(batch, f.name), non_blocking=True)
        if state_slots is not None:
            self.state_slots.copy_(state_slots, non_blocking=True)
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
        padded = pad_decode_batch(batch, key.rows, key.table_width)
        slots = None if state_slots is None else torch.cat(
            [state_slots, state_slots.new_full((key.rows - state_slots.shape[0],), -1)])
        graph = self.graphs.get(key)
        if graph is None:
            if self.pool is None:
                self.pool = torch.cuda.graph_pool_handle()
            graph = self.graphs[key] = _Graph(self.forward, padded, external, key.with_state, self.warmups,
                                              self.pool)
        return graph.replay(padded, slots)[:batch.input_ids.shape[0]]
