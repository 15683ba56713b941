"""Which GGUF tensors make each Hugging Face tensor our models read, and how: llama.cpp's converter undone.

The HF names are those our model classes ask a checkpoint for: `expected_tensors` builds the model on the
meta device against a checkpoint that records each request. Each name maps to its GGUF name through the gguf
package's own TensorNameMap for the architecture, after the converter's renames (_RENAMES). What else
convert_hf_to_gguf.py does to a tensor is inverted here:
  llama            q/k rows stored in rotary pair order -> each head's two halves (rows)
  Gated DeltaNet   A_log stored as -exp(A_log) -> log(-a); conv1d squeezed -> [C, 1, K]; Qwen3-Next's
                   in_proj_qkvz split into attn_qkv + attn_gate -> [q, k, v, z] per key head again (rows)
  zero-centred     norms of Qwen3-Next / Qwen3.5 (all but linear_attn.norm) stored as 1 + w -> minus 1
  Qwen3.5          with fewer key than value heads, value heads stored tiled ([k0, k1, k0, k1, ...]) rather
                   than grouped by key head: in_proj_qkv's v rows, in_proj_z/a/b rows, A_log, dt_bias,
                   conv1d's v rows (rows) and out_proj's inputs (columns) go back to grouped
  MoE              experts stacked as ffn_{gate,up,down}_exps -> experts.gate_up_proj [E, 2I, H] and
                   experts.down_proj [E, H, I] (joined along I)
Row picks and joins apply to group form as well, since a quantized row stands alone; column picks only
where they move whole blocks of the file's format (gguf_weights.py widens the tensor otherwise).
"""
from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from dataclasses import dataclass

import gguf
import torch

from engine.loading.gguf_config import GGUFContentError
from engine.loading.model_config import ModelConfig, ModelConfigError, parse_model_config
from engine.models.decoder import build_decoder
from engine.models.linear import LinearLoader

_ARCHS = {name: arch for arch, name in gguf.MODEL_ARCH_NAMES.items()}
# HF name endings -> the names llama.cpp's converter gives those tensors before its name map
_RENAMES = {
    ".linear_attn.dt_bias": (".linear_attn.dt_proj.bias",),
    ".linear_attn.in_proj_qkvz.weight": (".linear_attn.in_proj_qkv.weight", ".linear_attn.in_proj_z.weight"),
    ".mlp.experts.gate_up_proj": (".mlp.experts.gate_proj.weight", ".mlp.experts.up_proj.weight"),
    ".mlp.experts.down_proj": (".mlp.experts.down_proj.weight",),
}
# converted by _LinearAttentionVReorderBase: value heads tiled for ggml's broadcasting
_TILED_VALUE_HEADS = {"qwen35", "qwen35moe"}
_BLOCK = re.compile(r"blk\.(\d+)\.")


@dataclass(frozen=True)
class Planned:
    """One HF tensor: its GGUF `sources` joined along `join_dim`, then rows and columns picked (HF row i is
    joined row rows[i]), then `values` applied to the dense fp32 result (an elementwise or shape inverse)."""
    name: str
    sources: tuple
    linear: bool                    # read through the linear loader: may be stored in group form
    join_dim: int = 0
    rows: torch.Tensor | None = None
    cols: torch.Tensor | None = None
    values: Callable[[torch.Tensor], torch.Tensor] | None = None


def tensor_plan(reader: gguf.GGUFReader, arch: str, config: dict) -> list[Planned]:
    """The HF tensors of `config`'s model from the file's tensors. Blocks past the decoder's layers (MTP) are
    skipped; any other tensor that makes no HF tensor, or a missing one, is an error before any data is read."""
    try:
        cfg = parse_model_config(config, "the config rebuilt from its metadata")
    except ModelConfigError as e:
        raise GGUFContentError(str(e)) from None
    names, linear = expected_tensors(cfg)
    tmap = gguf.get_tensor_name_map(_ARCHS[arch], cfg.num_layers)
    sources = {name: [_gguf_name(tmap, source, arch) for source in _sources(name)] for name in names}
    known = {n for names in sources.values() for n in names}
    tensors = {t.name: t for t in reader.tensors}
    for name in tensors:
        block = _BLOCK.match(name)
        if name not in known and not (block and int(block[1]) >= cfg.num_layers):
            listing = ", ".join(sorted({_BLOCK.sub("blk.N.", n) for n in known}))
            raise GGUFContentError(f"tensor {name!r} is not part of a supported {arch} model (known: {listing})")
    missing = next((n for names in sources.values() for n in names if n not in tensors), None)
    if missing is not None:
        raise GGUFContentError(f"tensor {missing!r} is missing")
    return [Planned(name, tuple(tensors[n] for n in names), name in linear, **_inverse(name, cfg, arch))
            for name, names in sources.items()]


class _Recorder:
    """A checkpoint that holds whatever is asked for, on the meta device, and notes each request: a model
    built against it lists the tensors it reads, in order, and which go through the linear loader."""

    def __init__(self, cfg: ModelConfig):
        self.read: dict[str, None] = {}
        self.linear: set[str] = set()
        # the MoE block reads stacked experts when a checkpoint has them, and that is how they are written
        self._names = {f"model.layers.{i}.mlp.experts.gate_up_proj" for i in range(cfg.num_layers)}

    def names(self) -> set[str]:
        return self._names

    def is_quantized(self, name: str) -> bool:
        return False

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        self.read[name] = None
        return torch.empty(shape, dtype=dtype, device="meta")

    def get_linear(self, name: str, shape: tuple[int, int], dtype: torch.dtype, rows: torch.Tensor | None = None):
        self.linear.add(name)
        whole = self.get(name, shape, dtype)
        return whole if rows is None else whole.new_empty((len(rows), shape[1]))


def expected_tensors(cfg: ModelConfig) -> tuple[list[str], set[str]]:
    """(HF names, those read as linear weights) of the tensors our model for `cfg` loads, in its order."""
    recorder, meta = _Recorder(cfg), torch.device("meta")
    # one rotary position: the table is all the model computes for real
    build_decoder(dataclasses.replace(cfg, max_position_embeddings=1), recorder, torch.float32, meta,
                  LinearLoader(recorder, torch.float32, meta))
    return list(recorder.read), recorder.linear


def _sources(name: str) -> list[str]:
    for ending, replacements in _RENAMES.items():
        if name.endswith(ending):
            return [name.removesuffix(ending) + r for r in replacements]
    return [name]


def _gguf_name(tmap: gguf.TensorNameMap, name: str, arch: str) -> str:
    found = tmap.get_type_and_name(name, try_suffixes=(".weight", ".bias"))
    if found is None:
        raise GGUFContentError(f"the gguf package's {arch} tensor names have none for {name!r}; "
                               f"a newer gguf package may know it")
    return found[1]


def _inverse(name: str, cfg: ModelConfig, arch: str) -> dict:
    """Planned's join_dim / rows / cols / values for HF tensor `name`."""
    if arch == "llama" and ".self_attn.q_proj." in name:
        return {"rows": _halves_from_pairs(cfg.num_heads, cfg.head_dim)}
    if arch == "llama" and ".self_attn.k_proj." in name:
        return {"rows": _halves_from_pairs(cfg.num_kv_heads, cfg.head_dim)}
    if cfg.zero_centred_norm and name.endswith("norm.weight") and not name.endswith(".linear_attn.norm.weight"):
        return {"values": _minus_one}
    if name.endswith(".experts.gate_up_proj"):
        return {"join_dim": -2}
    if name.endswith(".in_proj_qkvz.weight"):
        return {"rows": _qkvz_rows(cfg)}
    inverse = {}
    if name.endswith(".linear_attn.A_log"):
        inverse["values"] = _log_of_negated
    if name.endswith(".linear_attn.conv1d.weight"):
        inverse["values"] = _with_channel_dim
    if arch in _TILED_VALUE_HEADS and cfg.linear_num_key_heads != cfg.linear_num_value_heads:
        inverse.update(_grouped_value_heads(name, cfg))
    return inverse


def _minus_one(w: torch.Tensor) -> torch.Tensor:
    return w - 1


def _log_of_negated(a: torch.Tensor) -> torch.Tensor:
    return torch.log(-a)


def _with_channel_dim(w: torch.Tensor) -> torch.Tensor:
    return w.unsqueeze(1)


def _halves_from_pairs(heads: int, head_dim: int) -> torch.Tensor:
    """llama.cpp stores each head's rotary rows as pairs [0, d/2, 1, d/2 + 1, ...]; HF as halves."""
    return torch.arange(heads * head_dim).view(heads, head_dim // 2, 2).transpose(1, 2).reshape(-1)


def _qkvz_rows(cfg: ModelConfig) -> torch.Tensor:
    """Joined rows [q, k, v] (attn_qkv) then z (attn_gate), each all heads in turn -> [q, k, v, z] per key head."""
    hk = cfg.linear_num_key_heads
    kd, vd = hk * cfg.linear_key_head_dim, cfg.linear_num_value_heads * cfg.linear_value_head_dim
    parts = [start + torch.arange(size).view(hk, -1)
             for start, size in ((0, kd), (kd, kd), (2 * kd, vd), (2 * kd + vd, vd))]
    return torch.cat(parts, dim=1).reshape(-1)


def _grouped_value_heads(name: str, cfg: ModelConfig) -> dict:
    """Rows (or columns) in grouped value-head order [k0's v0..v(r-1), k1's ...] from the tiled order."""
    hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    qk = 2 * hk * cfg.linear_key_head_dim

    def grouped(d: int) -> torch.Tensor:
        return torch.arange(hv * d).view(hv // hk, hk, d).transpose(0, 1).reshape(-1)
    dv = cfg.linear_value_head_dim
    if name.endswith((".linear_attn.in_proj_qkv.weight", ".linear_attn.conv1d.weight")):
        return {"rows": torch.cat([torch.arange(qk), qk + grouped(dv)])}
    if name.endswith(".linear_attn.in_proj_z.weight"):
        return {"rows": grouped(dv)}
    if name.endswith((".linear_attn.in_proj_a.weight", ".linear_attn.in_proj_b.weight", ".linear_attn.A_log",
                      ".linear_attn.dt_bias")):
        return {"rows": grouped(1)}
    if name.endswith(".linear_attn.out_proj.weight"):
        return {"cols": grouped(dv)}
    return {}
