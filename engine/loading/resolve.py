"""Turn a user's model spec (preset name, checkpoint directory or .gguf file) into an HF checkpoint dir.

A preset name always means the preset, even if a directory of that name exists in the working
directory (write `./name` for that). The spec becomes a path only when it names an existing
directory or a .gguf file; the server checks client-given names against its own allowlist first.
"""
from __future__ import annotations

from pathlib import Path

from engine.loading.presets import PRESETS, Progress, pull, pulled_path
from engine.errors import UserError


class ModelNotFound(UserError, LookupError):
    """The spec is neither a preset, nor a checkpoint directory, nor a .gguf file."""


def resolve_model(
    spec: str,
    *,
    dtype: str,
    pull_missing: bool = True,
    progress: Progress | None = None,
    cache_root: Path | None = None,
    keep_quantized: bool = False,
) -> Path:
    """Return a Hugging Face layout checkpoint directory (config.json + safetensors) for `spec`.

    `progress(done_bytes, total_bytes)` reports a preset's download; GGUF conversion output lands in
    `cache_root` (the user cache dir by default); `keep_quantized` keeps a GGUF's quantized linear
    weights in group form instead of widening them.
    """
    if spec in PRESETS:
        return _gguf_to_hf(_preset_gguf(spec, pull_missing, progress, cache_root), dtype, cache_root,
                           keep_quantized)
    path = Path(spec).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFound(
                f"directory {path} is not a checkpoint: it has no config.json (a Hugging Face checkpoint "
                f"directory holds config.json and *.safetensors); or use a preset: {', '.join(PRESETS)}"
            )
        return path
    if path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise ModelNotFound(f"GGUF file {path} does not exist")
        return _gguf_to_hf(path, dtype, cache_root, keep_quantized)
    raise ModelNotFound(
        f"model {spec!r} is not a preset ({', '.join(PRESETS)}), a checkpoint directory or a .gguf file; "
        f"a directory or file path must exist"
    )


def _preset_gguf(name: str, pull_missing: bool, progress: Progress | None, cache_root: Path | None) -> Path:
    if pull_missing:
        return pull(name, progress=progress, cache_root=cache_root)
    path = pulled_path(name, cache_root)
    if path is None:
        raise ModelNotFound(f"preset {name!r} is not downloaded yet; run `pagedserve pull {name}` first")
    return path


def _gguf_to_hf(gguf_path: Path, dtype: str, cache_root: Path | None, keep_quantized: bool) -> Path:
    from engine.loading.gguf import gguf_to_hf_dir  # imports torch and gguf: only when a GGUF is used

    # presets and conversions share one root: conversions live in its gguf/ folder
    return gguf_to_hf_dir(gguf_path, dtype=dtype, keep_quantized=keep_quantized,
                          cache_root=None if cache_root is None else cache_root / "gguf")
