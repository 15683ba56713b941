"""Planned HF tensors (gguf_tensors.py) -> safetensors shards, dequantized or kept in group form.

A tensor is dequantized a band of rows at a time (an embedding of 150k rows would need several GB of fp32
at once), into the run dtype. Kept (`keep_quantized`), a linear weight stored in one of gguf_quant's types
is written in group form instead, with the plan's row and column picks applied to its values and factors:
rows always can be, columns when they move whole blocks of the format; otherwise the tensor is widened.
The embedding table is written dense as well: `none`, `int8` and `int4` look rows up there, while `auto`
dequantizes just the rows it looks up from the group form (which, tied, is also the output head: a dense
head of Qwen3-0.6B's vocabulary is 622 MB of fp32 a step).
"""
from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, quants
from safetensors.torch import save_file

from engine.loading import gguf_quant
from engine.loading.checkpoint import group_tensor_names
from engine.loading.gguf_config import GGUFContentError
from engine.loading.gguf_tensors import Planned

SUPPORTED_TYPES = tuple(GGMLQuantizationType[name] for name in (
    "F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"))
EMBEDDING = "model.embed_tokens.weight"
SHARD_BYTES = 2 * 1024**3
DEQUANT_BAND_ELEMENTS = 16 * 1024**2

# progress(tensors_done, tensors_total, hf_tensor_name), called after each written tensor
Progress = Callable[[int, int, str], None]


def check_types(tensors) -> None:
    supported = ", ".join(t.name for t in SUPPORTED_TYPES)
    for t in tensors:
        if t.tensor_type not in SUPPORTED_TYPES:
            raise GGUFContentError(f"tensor {t.name!r} has type {t.tensor_type.name}, which cannot be "
                                   f"dequantized here; supported: {supported}")


def kept_in_groups(plan: list[Planned]) -> set[str]:
    """The HF names of the planned tensors that can be written in group form."""
    def keeps(p: Planned) -> bool:
        kinds = {t.tensor_type for t in p.sources}
        if not (p.linear or p.name == EMBEDDING) or p.values is not None or len(kinds) != 1:
            return False
        kind = kinds.pop()
        return (kind in gguf_quant.KEPT_TYPES and all(len(t.shape) == 2 for t in p.sources)
                and (p.cols is None or _moves_whole_blocks(p.cols, quants.GGML_QUANT_SIZES[kind][0])))
    return {p.name for p in plan if keeps(p)}


def _moves_whole_blocks(cols: torch.Tensor, block: int) -> bool:
    """Whether the column pick takes whole aligned blocks of `block` values, each in order."""
    if len(cols) % block:
        return False
    runs = cols.view(-1, block)
    return bool((runs[:, 0] % block == 0).all() and (runs == runs[:, :1] + torch.arange(block)).all())


def _writes_dense(name: str, kept: set[str]) -> bool:
    return name not in kept or name == EMBEDDING


def _shards(plan: list[Planned], dtype: torch.dtype, kept: set[str]) -> list[list[Planned]]:
    """Tensors grouped in plan order into shards of at most SHARD_BYTES as written (a kept tensor
    is about one byte per value)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    shards, size = [[]], 0
    for p in plan:
        values = sum(int(np.prod(t.shape)) for t in p.sources)
        nbytes = values * ((p.name in kept) + itemsize * _writes_dense(p.name, kept))
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(p)
        size += nbytes
    return shards


def write_weights(plan: list[Planned], out: Path, dtype: torch.dtype, kept: set[str],
                  progress: Progress | None) -> None:
    shards = _shards(plan, dtype, kept)
    total, done = len(plan), 0
    weight_map, total_size = {}, 0
    for number, shard in enumerate(shards, start=1):
        file = "model.safetensors" if len(shards) == 1 else f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for p in shard:
            written = {}
            if p.name in kept:
                written.update(zip(group_tensor_names(p.name), _groups(p)))
            if _writes_dense(p.name, kept):
                written[p.name] = _dense(p, dtype)
            for name, tensor in written.items():
                if tensor is not None:
                    tensors[name] = tensor
                    weight_map[name] = file
                    total_size += tensor.numel() * tensor.element_size()
            done += 1
            if progress is not None:
                progress(done, total, p.name)
        save_file(tensors, str(out / file), metadata={"format": "pt"})
        del tensors  # release this shard before the next one is built
    if len(shards) > 1:
        index = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2), encoding="utf-8")


def _bands(t):
    """(HF shape, raw rows, rows per band) of a GGUF tensor."""
    shape = tuple(int(d) for d in reversed(t.shape))  # GGUF lists dims innermost first
    rows = int(np.prod(shape[:-1]))
    return shape, t.data.reshape(rows, -1), max(1, DEQUANT_BAND_ELEMENTS // shape[-1])


def _dequantized(t, dtype: torch.dtype) -> torch.Tensor:
    shape, data, band = _bands(t)
    out = torch.empty(shape, dtype=dtype)
    flat_out = out.reshape(-1, shape[-1])
    for start in range(0, data.shape[0], band):
        values = quants.dequantize(data[start:start + band], t.tensor_type)
        values = np.require(values, np.float32, ["W"])  # F32 comes back as a view of the mapped file
        flat_out[start:start + band] = torch.from_numpy(values).reshape(-1, shape[-1])
    return out


def _dense(p: Planned, dtype: torch.dtype) -> torch.Tensor:
    """The HF tensor in `dtype`; a `values` inverse is computed in fp32 (1 + w less 1 in bf16 would lose w)."""
    work = torch.float32 if p.values is not None else dtype
    parts = [_dequantized(t, work) for t in p.sources]
    x = parts[0] if len(parts) == 1 else torch.cat(parts, dim=p.join_dim)
    if p.rows is not None:
        x = x.index_select(0, p.rows)
    if p.cols is not None:
        x = x.index_select(-1, p.cols)
    if p.values is not None:
        x = p.values(x).to(dtype)
    return x.contiguous()


def _group_parts(t) -> list[torch.Tensor | None]:
    """One GGUF tensor in group form (q, scales, mins, supers), each [rows, ...]."""
    shape, data, band = _bands(t)
    parts = [gguf_quant.groups(data[start:start + band], t.tensor_type, (min(band, shape[0] - start), shape[1]))
             for start in range(0, shape[0], band)]
    return [None if part[0] is None else torch.cat(part) for part in zip(*parts)]


def _groups(p: Planned) -> tuple:
    """The HF weight in group form: sources joined by rows, then the plan's rows and whole-block columns picked
    in every part (a part with one entry per `width` columns takes every width-th pick, divided by width)."""
    parts = [_group_parts(t) for t in p.sources]
    joined = [None if part[0] is None else torch.cat(part) for part in zip(*parts)]
    columns = joined[0].shape[1]

    def arranged(part: torch.Tensor | None) -> torch.Tensor | None:
        if part is None:
            return None
        if p.rows is not None:
            part = part.index_select(0, p.rows)
        if p.cols is not None:
            width = columns // part.shape[1]
            part = part.index_select(1, p.cols[::width] // width)
        return part.contiguous()
    return tuple(map(arranged, joined))
