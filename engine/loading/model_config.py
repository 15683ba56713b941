"""The architecture facts the engine needs, read from a Hugging Face config.json dict."""
from __future__ import annotations

from dataclasses import dataclass

# architecture name -> family flags; one dense implementation serves all three
DENSE_ARCHITECTURES = {
    "Qwen3ForCausalLM": dict(qkv_bias=False, qk_norm=True),
    "Qwen2ForCausalLM": dict(qkv_bias=True, qk_norm=False),
    "LlamaForCausalLM": dict(qkv_bias=None, qk_norm=False),  # None: from `attention_bias`
}


class ModelConfigError(ValueError):
    """config.json does not describe a model we can run; the message says which key and why."""


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    partial_rotary_factor: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)


def _rope(cfg: dict) -> tuple[float, float]:
    """transformers 5 nests rope settings in `rope_parameters`; older files keep them top level."""
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or {}
    kind = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if kind != "default":
        raise ModelConfigError(f"rope type {kind!r} is not supported (only 'default' rotary)")
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    factor = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    return float(theta), float(factor)


def _ids(value) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, (list, tuple)) else (int(value),)


def parse_model_config(cfg: dict, source: str = "config.json") -> ModelConfig:
    archs = cfg.get("architectures") or []
    arch = next((a for a in archs if a in DENSE_ARCHITECTURES), None)
    if arch is None:
        known = ", ".join(DENSE_ARCHITECTURES)
        raise ModelConfigError(f"{source}: architecture {archs or '(none)'} is not supported; "
                               f"supported: {known}")
    flags = DENSE_ARCHITECTURES[arch]
    try:
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        theta, factor = _rope(cfg)
        qkv_bias = flags["qkv_bias"]
        if qkv_bias is None:
            qkv_bias = bool(cfg.get("attention_bias", False))
        if cfg.get("mlp_bias"):
            raise ModelConfigError(f"{source}: mlp_bias=true is not supported")
        return ModelConfig(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            partial_rotary_factor=factor,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=bool(qkv_bias),
            qk_norm=flags["qk_norm"],
            eos_token_ids=_ids(cfg.get("eos_token_id")),
            bos_token_id=cfg.get("bos_token_id"),
        )
    except KeyError as e:
        raise ModelConfigError(f"{source}: required key {e.args[0]!r} is missing") from None
    except (TypeError, ValueError) as e:
        if isinstance(e, ModelConfigError):
            raise
        raise ModelConfigError(f"{source}: {e}") from None
