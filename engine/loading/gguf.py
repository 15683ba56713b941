"""GGUF files -> a cached Hugging Face checkpoint dir that the normal loader reads.

`gguf_to_hf_dir` converts a file once: config.json from its metadata (gguf_config.py), the HF tensors our
models read planned from its tensors with llama.cpp's conversion undone (gguf_tensors.py), written
dequantized one tensor at a time, or with `keep_quantized` linear weights in group form (gguf_weights.py,
gguf_quant.py), and the tokenizer files (gguf_tokenizer.py), all into
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
from pathlib import Path

import torch
from gguf import GGUFReader

from engine.atomic_file import write_atomic
from engine.errors import UserError
from engine.loading.gguf_config import ARCHITECTURES, GGUFContentError, hf_config
from engine.loading.gguf_tensors import tensor_plan
from engine.loading.gguf_tokenizer import GGUFTokenizerError, write_tokenizer_files
from engine.loading.gguf_weights import Progress, check_types, kept_in_groups, write_weights

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}
HASH_CHUNK = 8 * 1024**2
MARKER = "complete.json"
# The stored group form's version; a quantized entry written in another one is converted again
# (2: K-quants keep their two-level scales; 3: Q6_K is kept as int6, no longer requantized to int8;
# 4: a tied embedding table is kept in group form too, as the output head; 5: the embedding table is kept
# in group form tied or not, for lookups that dequantize their rows).
GROUP_FORMAT = 5
HASH_INDEX = "hash-index.json"
BUILD_TAG = ".tmp-"     # in the names of conversions under way: .<entry>.tmp-<pid>-<random>


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
    meta = {key: field.contents() for key, field in reader.fields.items() if not key.startswith("GGUF.")}
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise GGUFError(f"{path.name}: architecture {arch!r} is not supported; supported: {sorted(ARCHITECTURES)}")
    try:
        check_types(reader.tensors)
        shapes = {t.name: tuple(int(d) for d in reversed(t.shape)) for t in reader.tensors}
        config = hf_config(meta, arch, shapes, str(dtype).removeprefix("torch."))
        plan = tensor_plan(reader, arch, config)
        (out / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
        write_weights(plan, out, dtype, kept_in_groups(plan) if keep_quantized else set(), progress)
        write_tokenizer_files(meta, out)
    except (GGUFContentError, GGUFTokenizerError) as e:
        raise GGUFError(f"{path.name}: {e}") from None
