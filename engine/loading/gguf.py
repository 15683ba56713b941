"""GGUF files -> a cached Hugging Face checkpoint dir that the normal loader reads.

`gguf_to_hf_dir` dequantizes every tensor once (one at a time, so a 1 GB Q4_K_M file never has all
its fp32 copies in memory), or with `keep_quantized` stores quantized linear weights in group form
(gguf_quant.py) instead; renames each to the HF name, undoes llama.cpp's Q/K row permutation for
llama, and writes config.json, safetensors shards, tokenizer files and generation_config.json into
`<cache>/<sha256[:16]>-<dtype>[-quantized]`. A later call finds that entry by the file's hash
(remembered per path, size and mtime, so a warm start does not re-hash) and returns at once.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, quants
from safetensors.torch import save_file

from engine.atomic_file import write_atomic
from engine.loading import gguf_quant
from engine.loading.checkpoint import group_tensor_names
from engine.loading.gguf_tokenizer import GGUFTokenizerError, write_tokenizer_files
from engine.errors import UserError

# GGUF `general.architecture` -> (HF architecture, HF model_type)
ARCHITECTURES = {
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "llama": ("LlamaForCausalLM", "llama"),
}
SUPPORTED_TYPES = tuple(GGMLQuantizationType[name] for name in (
    "F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"))
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}

EMBEDDING = "token_embd.weight"
_GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}
SHARD_BYTES = 2 * 1024**3
DEQUANT_BAND_ELEMENTS = 16 * 1024**2
HASH_CHUNK = 8 * 1024**2
MARKER = "complete.json"
# The stored group form's version; a quantized entry written in another one is converted again
# (2: K-quants keep their two-level scales; 3: Q6_K is kept as int6, no longer requantized to int8;
# 4: a tied embedding table is kept in group form too, as the output head; 5: the embedding table is kept
# in group form tied or not, for lookups that dequantize their rows).
GROUP_FORMAT = 5
HASH_INDEX = "hash-index.json"
BUILD_TAG = ".tmp-"     # in the names of conversions under way: .<entry>.tmp-<pid>-<random>

# progress(tensors_done, tensors_total, tensor_name), called after each converted tensor
Progress = Callable[[int, int, str], None]


class GGUFError(UserError, ValueError):
    """The GGUF file cannot be converted; the message names the file, the key/tensor and what is supported."""


def default_cache_root() -> Path:
    import platformdirs

    return platformdirs.user_cache_path("pagedserve") / "gguf"


def gguf_to_hf_dir(gguf_path: str | Path, dtype: str = "bfloat16", cache_root: Path | None = None,
                   progress: Progress | None = None, keep_quantized: bool = False) -> Path:
    """The HF checkpoint dir for this GGUF file in `dtype`, converted on first use and cached.
    `keep_quantized`: linear weights in a quantized type are stored in group form (gguf_quant.py)
    instead of widened; embeddings, norms and biases are widened either way."""
    path = Path(gguf_path).expanduser().resolve()
    if dtype not in DTYPES:
        raise GGUFError(f"dtype {dtype!r} is not supported for GGUF conversion; choose one of {sorted(DTYPES)}")
    if not path.is_file():
        raise GGUFError(f"{path}: no such GGUF file")
    root = Path(cache_root) if cache_root is not None else default_cache_root()
    root.mkdir(parents=True, exist_ok=True)
    digest = _file_sha256(path, root)
    entry = root / f"{digest[:16]}-{dtype}{'-quantized' if keep_quantized else ''}"
    if _entry_is_complete(entry, digest, keep_quantized):
        return entry
    return _build_entry(path, digest, dtype, entry, progress, keep_quantized)


# ---- cache -------------------------------------------------------------------------------------

def _file_sha256(path: Path, root: Path) -> str:
    """sha256 of the file, remembered by (path, size, mtime) in the cache's index."""
    stat = path.stat()
    index_file = root / HASH_INDEX
    try:
        index = json.loads(index_file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        index = {}  # a missing or damaged index only costs one re-hash
    known = index.get(str(path))
    if isinstance(known, dict) and known.get("size") == stat.st_size and known.get("mtime_ns") == stat.st_mtime_ns:
        return known["sha256"]
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK):
            sha.update(chunk)
    index[str(path)] = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "sha256": sha.hexdigest()}
    _write_json_atomic(index_file, index)
    return sha.hexdigest()


def _entry_is_complete(entry: Path, digest: str, keep_quantized: bool) -> bool:
    """Quick check: marker with the full hash (and the group form's version), and every file it lists
    present with its size."""
    try:
        marker = json.loads((entry / MARKER).read_text(encoding="utf-8"))
        group_format = GROUP_FORMAT if keep_quantized else None
        return (marker["sha256"] == digest and marker.get("group_format") == group_format
                and all((entry / name).stat().st_size == size for name, size in marker["files"].items()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def _build_entry(path: Path, digest: str, dtype: str, entry: Path, progress: Progress | None,
                 keep_quantized: bool) -> Path:
    """Convert into a temp dir beside the entry, then rename it into place (replacing a damaged one)."""
    _remove_dead_builds(entry.parent)
    tmp, lock = _locked_build_dir(entry)
    try:
        _convert(path, tmp, DTYPES[dtype], progress, keep_quantized)
        files = {p.name: p.stat().st_size for p in sorted(tmp.iterdir())}
        marker = {"sha256": digest, "dtype": dtype, "source": str(path), "files": files}
        if keep_quantized:
            marker["group_format"] = GROUP_FORMAT
        _write_json_atomic(tmp / MARKER, marker)
        if entry.exists():
            shutil.rmtree(entry)
        try:
            os.rename(tmp, entry)
        except OSError:
            if not _entry_is_complete(entry, digest, keep_quantized):  # another process did not just finish it
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        os.close(lock)
    return entry


def _locked_build_dir(entry: Path) -> tuple[Path, int]:
    """A fresh temp dir beside the entry and an open descriptor holding its flock. The kernel drops the
    lock however the process ends (SIGKILL too), so an unlocked temp dir is a dead build's leftover."""
    while True:
        tmp = entry.parent / f".{entry.name}{BUILD_TAG}{os.getpid()}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        try:
            lock = os.open(tmp, os.O_RDONLY | os.O_DIRECTORY)
        except FileNotFoundError:
            continue        # a cleaner took it between mkdir and open: take another name
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _names_this_dir(tmp, lock):
            return tmp, lock
        os.close(lock)      # a cleaner removed it between open and flock


def _names_this_dir(path: Path, fd: int) -> bool:
    try:
        return os.stat(path).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        return False


def _remove_dead_builds(root: Path) -> None:
    """Delete the temp dirs of conversions killed midway (each can be as big as the model); a live
    build holds its dir's flock, so its dir is skipped."""
    for tmp in root.glob(f".*{BUILD_TAG}*"):
        try:
            lock = os.open(tmp, os.O_RDONLY | os.O_DIRECTORY)
        except OSError:
            continue        # gone meanwhile, or not a directory
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            shutil.rmtree(tmp, ignore_errors=True)
        except BlockingIOError:
            pass            # a live build
        finally:
            os.close(lock)


def _write_json_atomic(file: Path, data: dict) -> None:
    write_atomic(file, json.dumps(data, indent=2, ensure_ascii=False))


# ---- conversion --------------------------------------------------------------------------------

def _convert(path: Path, out: Path, dtype: torch.dtype, progress: Progress | None, keep_quantized: bool) -> None:
    try:
        reader = GGUFReader(path)
    except (ValueError, OSError) as e:
        raise GGUFError(f"{path}: not a readable GGUF file ({e})") from None
    meta = _metadata(reader)
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise GGUFError(f"{path.name}: architecture {arch!r} is not supported; supported: {sorted(ARCHITECTURES)}")
    names = _check_tensors(path, reader, arch)
    config = _hf_config(path, meta, arch, reader, dtype)
    (out / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    kept = {t.name for t in reader.tensors if keep_quantized and _keeps_quantized(t)}
    _write_weights(reader, names, out, dtype, config, progress, kept)
    try:
        write_tokenizer_files(meta, out)
    except GGUFTokenizerError as e:
        raise GGUFError(f"{path.name}: {e}") from None


def _metadata(reader: GGUFReader) -> dict:
    return {key: field.contents() for key, field in reader.fields.items() if not key.startswith("GGUF.")}


def _hf_name(name: str) -> str | None:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`; None when unknown."""
    stem, _, kind = name.rpartition(".")
    if kind not in ("weight", "bias"):
        return None
    if stem in _GLOBAL_TENSORS:
        return f"{_GLOBAL_TENSORS[stem]}.{kind}"
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_TENSORS:
        return f"model.layers.{parts[1]}.{_LAYER_TENSORS[parts[2]]}.{kind}"
    return None


def _check_tensors(path: Path, reader: GGUFReader, arch: str) -> dict[str, str]:
    """GGUF name -> HF name for every tensor; fails before any dequantizing on anything unknown."""
    supported = ", ".join(t.name for t in SUPPORTED_TYPES)
    names = {}
    for t in reader.tensors:
        hf = _hf_name(t.name)
        if hf is None:
            raise GGUFError(f"{path.name}: tensor {t.name!r} is not part of a supported {arch} model "
                            f"(known: {sorted(_GLOBAL_TENSORS)} and blk.N.{{{', '.join(_LAYER_TENSORS)}}})")
        if t.tensor_type not in SUPPORTED_TYPES:
            raise GGUFError(f"{path.name}: tensor {t.name!r} has type {t.tensor_type.name}, which cannot be "
                            f"dequantized here; supported: {supported}")
        names[t.name] = hf
    for required in (EMBEDDING, "output_norm.weight"):
        if required not in names:
            raise GGUFError(f"{path.name}: tensor {required!r} is missing")
    return names


def _hf_config(path: Path, meta: dict, arch: str, reader: GGUFReader, dtype: torch.dtype) -> dict:
    def key(name: str, default=None):
        value = meta.get(f"{arch}.{name}", default)
        if value is None:
            raise GGUFError(f"{path.name}: metadata key {arch}.{name!r} is missing")
        return value

    scaling = meta.get(f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        raise GGUFError(f"{path.name}: {arch}.rope.scaling.type={scaling!r} is not supported (only plain rotary)")
    tensor_names = {t.name for t in reader.tensors}
    embed = next(t for t in reader.tensors if t.name == EMBEDDING)
    hidden, heads = int(key("embedding_length")), int(key("attention.head_count"))
    head_dim = int(key("attention.key_length", hidden // heads))
    rotary = int(key("rope.dimension_count", head_dim))
    architecture, model_type = ARCHITECTURES[arch]
    config = {
        "architectures": [architecture],
        "model_type": model_type,
        "hidden_size": hidden,
        "intermediate_size": int(key("feed_forward_length")),
        "num_hidden_layers": int(key("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(key("attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(key("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(key("context_length")),
        "vocab_size": int(embed.shape[1]),  # ne order: [hidden, vocab]
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "hidden_act": "silu",
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    if rotary != head_dim:
        config["partial_rotary_factor"] = rotary / head_dim
    if arch != "qwen2":  # Qwen2 always has q/k/v biases; the others say so in their config
        config["attention_bias"] = "blk.0.attn_q.bias" in tensor_names
        config["mlp_bias"] = False
    else:
        config["use_sliding_window"] = False
    return config


def _keeps_quantized(t) -> bool:
    """A weight in a type that has a group form. The embedding table is written dense as well: `none`,
    `int8` and `int4` look rows up there, while `auto` dequantizes just the rows it looks up from the
    group form (which, tied, is also the output head: a dense head of Qwen3-0.6B's vocabulary is 622 MB
    of fp32 a step)."""
    return t.tensor_type in gguf_quant.KEPT_TYPES and len(t.shape) == 2 and t.name.endswith(".weight")


def _writes_dense(name: str, kept: set[str]) -> bool:
    return name not in kept or name == EMBEDDING


def _shards(reader: GGUFReader, dtype: torch.dtype, kept: set[str]) -> list[list]:
    """Tensors grouped in file order into shards of at most SHARD_BYTES as written (a kept tensor
    is about one byte per value)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    shards, size = [[]], 0
    for t in reader.tensors:
        nbytes = int(np.prod(t.shape)) * ((t.name in kept) + itemsize * _writes_dense(t.name, kept))
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += nbytes
    return shards


def _write_weights(reader: GGUFReader, names: dict[str, str], out: Path, dtype: torch.dtype,
                   config: dict, progress: Progress | None, kept: set[str]) -> None:
    shards = _shards(reader, dtype, kept)
    total, done = len(reader.tensors), 0
    weight_map, total_size = {}, 0
    for number, shard in enumerate(shards, start=1):
        file = "model.safetensors" if len(shards) == 1 else f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for t in shard:
            written = {}
            if t.name in kept:
                written.update(zip(group_tensor_names(names[t.name]), _to_groups(t, config)))
            if _writes_dense(t.name, kept):
                written[names[t.name]] = _to_torch(t, config, dtype)
            for name, tensor in written.items():
                if tensor is not None:
                    tensors[name] = tensor
                    weight_map[name] = file
                    total_size += tensor.numel() * tensor.element_size()
            done += 1
            if progress is not None:
                progress(done, total, t.name)
        save_file(tensors, str(out / file), metadata={"format": "pt"})
        del tensors  # release this shard before the next one is built
    if len(shards) > 1:
        index = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2), encoding="utf-8")


def _bands(t):
    """(HF shape, raw rows, rows per band): tensors are converted a band of rows at a time so that
    only one band's fp32 intermediates exist (an embedding of 150k rows would need several GB at once)."""
    shape = tuple(int(d) for d in reversed(t.shape))  # GGUF lists dims innermost first
    rows = int(np.prod(shape[:-1]))
    return shape, t.data.reshape(rows, -1), max(1, DEQUANT_BAND_ELEMENTS // shape[-1])


def _to_torch(t, config: dict, dtype: torch.dtype) -> torch.Tensor:
    """The tensor in HF layout and `dtype`."""
    shape, data, band = _bands(t)
    out = torch.empty(shape, dtype=dtype)
    flat_out = out.reshape(-1, shape[-1])
    for start in range(0, data.shape[0], band):
        values = quants.dequantize(data[start:start + band], t.tensor_type)
        values = np.require(values, np.float32, ["W"])  # F32 comes back as a view of the mapped file
        flat_out[start:start + band] = torch.from_numpy(values).reshape(-1, shape[-1])
    return _hf_rows(t, config, out)


def _to_groups(t, config: dict) -> tuple:
    """The weight in group form (q, scales, mins), rows in HF order."""
    shape, data, band = _bands(t)
    parts = [gguf_quant.groups(data[start:start + band], t.tensor_type, (min(band, shape[0] - start), shape[1]))
             for start in range(0, shape[0], band)]
    return tuple(None if part[0] is None else _hf_rows(t, config, torch.cat(part))
                 for part in zip(*parts))


def _hf_rows(t, config: dict, rows: torch.Tensor) -> torch.Tensor:
    if config["model_type"] == "llama":
        heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
        kind = t.name.split(".")[-2] if t.name.startswith("blk.") else None
        if kind in heads:
            return _unpermute_rows(rows, heads[kind])
    return rows


def _unpermute_rows(tensor: torch.Tensor, heads: int) -> torch.Tensor:
    """Inverse of llama.cpp's rotary row order: it stores each head's rows as (half, pair) interleaved
    [0, d/2, 1, d/2+1, ...]; HF keeps the two halves apart."""
    rows = tensor.shape[0]
    return (tensor.reshape(heads, rows // heads // 2, 2, *tensor.shape[1:])
            .transpose(1, 2).reshape(tensor.shape).contiguous())
