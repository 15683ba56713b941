"""Hugging Face checkpoint directories: config.json plus safetensors weights (one file or shards).

Weights are memory-mapped with `safetensors.safe_open`; a tensor is read, checked against the shape
the model expects and cast to the run dtype (into process memory) only when the model asks for it.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from engine.errors import UserError

SINGLE_FILE = "model.safetensors"
GROUP_SUFFIXES = (".qvalues", ".qscales", ".qmins", ".qsupers")   # a weight stored quantized: group_tensor_names
INDEX_FILE = "model.safetensors.index.json"


def group_tensor_names(name: str) -> tuple[str, str, str, str]:
    """The stored names of a weight kept in group form (ops/quant_weight.py: w = scale * q + min):
    integer values [N, K] (uint8 = int4 values, int8 = int8), then float32 scales and mins [N, K/32]
    (mins absent when zero); or, with two-level scales, uint8 sub-scales and sub-mins and float32
    supers [N, K/256, 1 or 2]. uint8 values with int8 sub-scales [N, K/16] are int6 (Q6_K's form)."""
    return tuple(name + suffix for suffix in GROUP_SUFFIXES)


class CheckpointError(UserError, ValueError):
    """The checkpoint directory cannot be used; the message names the file (and tensor) and why."""


def _read_json(file: Path) -> dict:
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{file}: not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{file}: cannot be read ({e})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{file}: expected a JSON object, found {type(data).__name__}")
    return data


def _open_safetensors(file: Path):
    try:
        return safe_open(str(file), framework="pt")
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{file.name}: not a readable safetensors file, maybe truncated or "
                              f"corrupt ({e}); download it again") from None


class Checkpoint:
    """Tensors by name across the checkpoint's safetensors files, read on demand."""

    def __init__(self, path: Path, config: dict, weight_map: dict[str, str], listing: str):
        self.path = path
        self.config = config
        self._weight_map = weight_map           # tensor name -> file name inside `path`
        self._listing = listing                 # the file that says which tensors exist
        self._handles = {name: _open_safetensors(path / name) for name in sorted(set(weight_map.values()))}

    def names(self) -> set[str]:
        return set(self._weight_map)

    def has(self, name: str) -> bool:
        return name in self._weight_map

    def _locate(self, name: str) -> tuple[str, str]:
        """(file, stored name) for a model tensor name: the one place a name mapping would go.
        Multimodal Qwen3.5 checkpoints keep the text model's `model.*` under `model.language_model.*`."""
        if name in self._weight_map:
            return self._weight_map[name], name
        nested = "model.language_model." + name.removeprefix("model.")
        if name.startswith("model.") and nested in self._weight_map:
            return self._weight_map[nested], nested
        raise CheckpointError(f"{self._listing}: tensor {name!r} is missing")

    def is_quantized(self, name: str) -> bool:
        return self.has(group_tensor_names(name)[0])

    def get_linear(self, name: str, shape: tuple[int, int], dtype: torch.dtype, rows: torch.Tensor | None = None):
        """A linear layer's weight: a QuantizedWeight when the checkpoint keeps it in group form,
        else the dense tensor in `dtype`. `rows` (int64 indices) picks and orders the stored rows; in
        group form before packing, since each row's values and factors stand alone."""
        def picked(t: torch.Tensor | None) -> torch.Tensor | None:
            return t if rows is None or t is None else t.index_select(0, rows)
        if not self.is_quantized(name):
            return picked(self.get(name, shape, dtype))
        from ops.quant_weight import GROUP, HALF, QuantError, QuantizedWeight, supers_per_row

        values, scales, mins, supers = group_tensor_names(name)
        q = self._read(values, shape)
        groups = (shape[0], shape[1] // GROUP)
        bits = {torch.uint8: 4, torch.int8: 8}.get(q.dtype)
        if bits is None:
            raise CheckpointError(f"{self._locate(values)[0]}: tensor {values!r} is {q.dtype}; "
                                  "group values are uint8 (int4, int6) or int8")
        if bits == 4 and self._stored_dtype(scales) == "I8":
            bits = 6
        two_level = self.has(supers)
        factors = [self._read(scales, (shape[0], shape[1] // HALF) if bits == 6 else groups),
                   self._read(mins, groups) if self.has(mins) else None]
        if not two_level:
            factors = [None if t is None else t.float() for t in factors]
        supers_shape = (shape[0], supers_per_row(groups[1]), 1 + self.has(mins))
        try:
            return QuantizedWeight.from_groups(
                picked(q), picked(factors[0]), picked(factors[1]), bits,
                picked(self._read(supers, supers_shape)) if two_level else None)
        except QuantError as e:
            raise CheckpointError(f"{self._locate(values)[0]}: weight {name!r}: {e}") from None

    def _stored_dtype(self, name: str) -> str:
        """The safetensors dtype name ("I8", "F32", ...) of a tensor, without reading it."""
        file, stored = self._locate(name)
        return self._handle(file).get_slice(stored).get_dtype()

    def _handle(self, file: str):
        if file not in self._handles:
            raise CheckpointError(f"{file}: the checkpoint was closed after loading; open it again to read it")
        return self._handles[file]

    def close(self) -> None:
        """Unmap the files. What `get` returned was copied out, so once a model is built the mapped pages
        are only memory held (the default model kept 2.6 GB of them mapped)."""
        self._handles.clear()

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The tensor `name`, checked to have `shape`, cast once to `dtype`, contiguous, and copied out
        of the file mapping: a view of it would read its pages from disk the first time a step touches
        them (the default model's embedding rows of 8 new token ids took 8 ms; 72 ms at worst)."""
        return self._read(name, shape).to(dtype, copy=True).contiguous()

    def _read(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        file, stored = self._locate(name)
        handle = self._handle(file)
        try:
            found = tuple(handle.get_slice(stored).get_shape())
            if found != tuple(shape):
                raise CheckpointError(f"{file}: tensor {name!r} has shape {list(found)}, "
                                      f"the model config expects {list(shape)}")
            tensor = handle.get_tensor(stored)
        except SafetensorError as e:
            raise CheckpointError(f"{file}: tensor {name!r} cannot be read ({e}); "
                                  f"the file may be truncated") from None
        return tensor

    def sampling_defaults(self) -> dict[str, float]:
        """The sampling settings generation_config.json recommends (temperature, top_p, top_k,
        min_p, repetition_penalty); {} when the file has none."""
        file = self.path / "generation_config.json"
        data = _read_json(file) if file.is_file() else {}
        return {k: data[k] for k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
                if isinstance(data.get(k), (int, float)) and not isinstance(data.get(k), bool)}

    def generation_eos_ids(self) -> tuple[int, ...]:
        """End-of-sequence ids from generation_config.json; () when the file or key is absent."""
        file = self.path / "generation_config.json"
        if not file.is_file():
            return ()
        value = _read_json(file).get("eos_token_id")
        if value is None:
            return ()
        values = value if isinstance(value, list) else [value]
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
            raise CheckpointError(f"{file}: eos_token_id must be an int or a list of ints, found {value!r}")
        return tuple(values)


def _weight_map(path: Path) -> tuple[dict[str, str], str]:
    """(tensor name -> file name, the file that lists them)."""
    index = path / INDEX_FILE
    if index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index}: needs a non-empty 'weight_map' object (tensor name -> shard file)")
        for shard in sorted(set(weight_map.values())):
            if not (path / shard).is_file():
                raise CheckpointError(f"{index}: lists shard {shard!r}, which is missing from {path}")
        return dict(weight_map), INDEX_FILE
    single = path / SINGLE_FILE
    if single.is_file():
        return {name: SINGLE_FILE for name in _open_safetensors(single).keys()}, SINGLE_FILE
    others = sorted(p.name for p in path.glob("*.bin")) + sorted(p.name for p in path.glob("*.gguf"))
    hint = f" (found {', '.join(others)}: convert it to safetensors)" if others else ""
    raise CheckpointError(f"{path}: no {SINGLE_FILE} or {INDEX_FILE}{hint}")


def open_checkpoint(path: str | Path) -> Checkpoint:
    """Open a Hugging Face model directory: config.json and its safetensors weights."""
    path = Path(path).expanduser()
    if not path.exists():
        raise CheckpointError(f"{path}: no such directory; give a Hugging Face model directory")
    if not path.is_dir():
        raise CheckpointError(f"{path}: is a file; give the directory that holds config.json")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"{config_file}: missing; a Hugging Face model directory has config.json")
    return Checkpoint(path, _read_json(config_file), *_weight_map(path))
