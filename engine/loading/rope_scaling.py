"""Rotary position scaling, which lets a model serve more positions than it was trained on: what a
config.json or GGUF asks for, or what the `rope_scaling` / `rope_scale` keys put in its place.
ops/rotary.py builds the cos/sin table from `RopeScaling.params()`."""
from __future__ import annotations

from dataclasses import dataclass

KINDS = ("linear", "yarn", "llama3")
# the keys each kind reads besides factor and original_max_position_embeddings (as transformers names them)
_EXTRA = {"linear": (), "yarn": ("attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate"),
          "llama3": ("low_freq_factor", "high_freq_factor")}


@dataclass(frozen=True)
class RopeScaling:
    kind: str                               # one of KINDS
    factor: float
    original_max_position_embeddings: int   # the context the model was trained on
    extra: tuple[tuple[str, float | bool], ...] = ()  # the kind's other keys, as the config gave them

    def params(self) -> dict:
        """The Hugging Face rope-parameter dict (what ops.rope_cos_sin and transformers read)."""
        return {"rope_type": self.kind, "factor": self.factor,
                "original_max_position_embeddings": self.original_max_position_embeddings, **dict(self.extra)}

    @property
    def max_positions(self) -> int:
        """How many positions a yarn or linear scaling serves (as vLLM derives it): `factor` times the
        original context. (llama3 configs state theirs in max_position_embeddings.)"""
        return int(self.original_max_position_embeddings * self.factor)


def parse_rope_scaling(kind: str, params: dict, max_position_embeddings: int) -> tuple[RopeScaling | None, int]:
    """The scaling a config's rope parameters of type `kind` describe, and the positions the model serves;
    ValueError (model_config adds the file's name) for what cannot be served."""
    if kind == "default":
        return None, max_position_embeddings
    if kind not in KINDS:
        raise ValueError(f"rope type {kind!r} is not supported (plain rotary, or one of {', '.join(KINDS)})")
    original = int(params.get("original_max_position_embeddings") or max_position_embeddings)
    factor = params.get("factor")
    if factor is None and kind == "yarn":     # DeepSeek-style configs give the two lengths instead
        factor = max_position_embeddings / original
    if factor is None or float(factor) < 1:
        raise ValueError(f"{kind} rope scaling needs a 'factor' >= 1, got {factor!r}")
    missing = [k for k in _EXTRA[kind] if k not in params] if kind == "llama3" else []
    if missing:
        raise ValueError(f"llama3 rope scaling needs {', '.join(map(repr, missing))}")
    extra = tuple((k, params[k]) for k in _EXTRA[kind] if params.get(k) is not None)
    scaling = RopeScaling(kind, float(factor), original, extra)
    return scaling, max_position_embeddings if kind == "llama3" else scaling.max_positions


def override_rope_scaling(current: RopeScaling | None, max_position_embeddings: int, kind: str,
                          factor: float) -> tuple[RopeScaling | None, int]:
    """The engine keys rope_scaling / rope_scale applied to a model's own scaling: "auto" keeps it, "none"
    drops it (back to the trained context), "linear" / "yarn" scale the trained context `factor` times."""
    if kind == "auto":
        return current, max_position_embeddings
    original = current.original_max_position_embeddings if current else max_position_embeddings
    if kind == "none":
        return None, original
    scaling = RopeScaling(kind, float(factor), original)
    return scaling, scaling.max_positions
