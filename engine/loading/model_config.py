"""The architecture facts the engine needs, read from a Hugging Face config.json dict."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from engine.errors import UserError
from engine.loading.rope_scaling import RopeScaling, parse_rope_scaling

# architecture name -> family flags; one dense implementation serves all three
DENSE_ARCHITECTURES = {
    "Qwen3ForCausalLM": dict(qkv_bias=False, qk_norm=True),
    "Qwen2ForCausalLM": dict(qkv_bias=True, qk_norm=False),
    "LlamaForCausalLM": dict(qkv_bias=None, qk_norm=False),  # None: from `attention_bias`
}

# architecture name -> family flags for engine/models/qwen3_5.py (gated attention, Gated DeltaNet, MoE).
# Qwen3-MoE is a dense-attention decoder with an MoE MLP; the hybrid decoder runs it with no linear layers.
# `nested`: a multimodal checkpoint whose text model sits under `text_config` / `model.language_model.*`.
HYBRID_ARCHITECTURES = {
    "Qwen3NextForCausalLM": dict(gated_attention=True, zero_centred_norm=True, fused_linear_proj=True,
                                 shared_expert=True, nested=False),
    "Qwen3_5ForCausalLM": dict(gated_attention=True, zero_centred_norm=True, fused_linear_proj=False,
                               shared_expert=True, nested=False),
    "Qwen3_5ForConditionalGeneration": dict(gated_attention=True, zero_centred_norm=True,
                                            fused_linear_proj=False, shared_expert=True, nested=True),
    "Qwen3_5MoeForCausalLM": dict(gated_attention=True, zero_centred_norm=True, fused_linear_proj=False,
                                  shared_expert=True, nested=False),
    "Qwen3_5MoeForConditionalGeneration": dict(gated_attention=True, zero_centred_norm=True,
                                               fused_linear_proj=False, shared_expert=True, nested=True),
    "Qwen3MoeForCausalLM": dict(gated_attention=False, zero_centred_norm=False, fused_linear_proj=False,
                                shared_expert=False, nested=False),
}
# Qwen3.5-MoE always renormalises its top-k weights; the others read `norm_topk_prob`
_ALWAYS_NORM_TOPK = {"Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration"}
LAYER_TYPES = ("full_attention", "linear_attention")


class ModelConfigError(UserError, ValueError):
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
    max_position_embeddings: int                # positions served: the trained context, or as rope scaling stretches it
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    rope_scaling: RopeScaling | None = None     # None: plain rotary
    # hybrid / MoE families (HYBRID_ARCHITECTURES); the dense defaults below leave dense models unchanged
    layer_types: tuple[str, ...] = ()           # per layer: "full_attention" | "linear_attention"
    gated_attention: bool = False               # q_proj emits query and a sigmoid output gate per head
    zero_centred_norm: bool = False             # RMSNorm scales by (1 + weight)
    fused_linear_proj: bool = False             # Qwen3-Next in_proj_qkvz / in_proj_ba
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 0
    num_experts: int = 0                        # 0: every MLP is dense
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0    # 0: no shared expert
    norm_topk_prob: bool = False
    moe_layers: tuple[bool, ...] = ()           # per layer: MoE MLP (True) or dense MLP

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def rope_params(self) -> dict | None:
        """The rope scaling as ops.rope_cos_sin takes it."""
        return self.rope_scaling.params() if self.rope_scaling else None

    @property
    def is_hybrid(self) -> bool:
        """Served by engine/models/qwen3_5.py rather than the dense decoder."""
        return self.architecture in HYBRID_ARCHITECTURES

    @property
    def attention_layers(self) -> tuple[int, ...]:
        types = self.layer_types or ("full_attention",) * self.num_layers
        return tuple(i for i, t in enumerate(types) if t == "full_attention")

    @property
    def linear_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "linear_attention")


def _rope(cfg: dict) -> tuple[float, float, RopeScaling | None, int]:
    """theta, the rotary fraction, the scaling and the positions served. transformers 5 nests rope settings
    in `rope_parameters`; older files keep them top level, the scaling in `rope_scaling`, which (as in
    transformers) replaces rope_parameters where a file has both: model cards say to add it to config.json."""
    params = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}

    def first(key: str, default):
        return next((d[key] for d in (params, cfg.get("rope_parameters") or {}, cfg) if key in d), default)

    kind = params.get("rope_type") or params.get("type") or "default"
    theta, factor = first("rope_theta", 10000.0), first("partial_rotary_factor", 1.0)
    scaling, positions = parse_rope_scaling(kind, params, int(cfg.get("max_position_embeddings", 4096)))
    return float(theta), float(factor), scaling, positions


def _ids(value) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, (list, tuple)) else (int(value),)


def parse_model_config(cfg: dict, source: str = "config.json") -> ModelConfig:
    archs = cfg.get("architectures") or []
    hybrid = next((a for a in archs if a in HYBRID_ARCHITECTURES), None)
    if hybrid is not None:
        return _parse_hybrid(cfg, hybrid, source)
    arch = next((a for a in archs if a in DENSE_ARCHITECTURES), None)
    if arch is None:
        known = ", ".join([*DENSE_ARCHITECTURES, *HYBRID_ARCHITECTURES])
        raise ModelConfigError(f"{source}: architecture {archs or '(none)'} is not supported; "
                               f"supported: {known}")
    flags = DENSE_ARCHITECTURES[arch]
    try:
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        theta, factor, scaling, positions = _rope(cfg)
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
            max_position_embeddings=positions,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=bool(qkv_bias),
            qk_norm=flags["qk_norm"],
            eos_token_ids=_ids(cfg.get("eos_token_id")),
            bos_token_id=cfg.get("bos_token_id"),
            rope_scaling=scaling,
        )
    except KeyError as e:
        raise ModelConfigError(f"{source}: required key {e.args[0]!r} is missing") from None
    except (TypeError, ValueError) as e:
        if isinstance(e, ModelConfigError):
            raise
        raise ModelConfigError(f"{source}: {e}") from None


def _text_config(cfg: dict, arch: str, source: str) -> dict:
    """The text model's keys. A multimodal checkpoint nests them in `text_config`; its top-level
    `tie_word_embeddings` is the one that holds (transformers' AutoModelForCausalLM ignores it)."""
    if not HYBRID_ARCHITECTURES[arch]["nested"]:
        return cfg
    text = cfg.get("text_config")
    if not isinstance(text, dict):
        raise ModelConfigError(f"{source}: {arch} needs a 'text_config' object with the language model's keys")
    merged = dict(text)
    for key in ("tie_word_embeddings", "eos_token_id", "bos_token_id"):
        if key in cfg:
            merged[key] = cfg[key]
    return merged


def _layer_types(cfg: dict, layers: int, source: str) -> tuple[str, ...]:
    types = cfg.get("layer_types")
    if types is None:
        if "linear_num_value_heads" not in cfg:
            return ("full_attention",) * layers
        interval = int(cfg.get("full_attention_interval", 4))
        return tuple("full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers))
    bad = [t for t in types if t not in LAYER_TYPES]
    if len(types) != layers or bad:
        found = f"{len(types)} entries" + (f", e.g. {bad[0]!r}" if bad else "")
        raise ModelConfigError(f"{source}: layer_types must list {layers} entries (num_hidden_layers), "
                               f"each one of {', '.join(LAYER_TYPES)}; got {found}")
    return tuple(types)


def _parse_hybrid(cfg: dict, arch: str, source: str) -> ModelConfig:
    flags = HYBRID_ARCHITECTURES[arch]
    text = _text_config(cfg, arch, source)
    # MoE-only models (Qwen3.5-MoE) have no dense intermediate_size
    text = {"intermediate_size": 0, **text, "architectures": ["Qwen3ForCausalLM"]}
    try:
        base = parse_model_config(text, source)     # the shared keys, read exactly as for dense models
        layers = base.num_layers
        types = _layer_types(text, layers, source)
        experts = int(text.get("num_experts") or text.get("num_local_experts") or 0)
        sparse_step = int(text.get("decoder_sparse_step") or 1)
        dense_only = set(text.get("mlp_only_layers") or ())
        moe = tuple(experts > 0 and i not in dense_only and (i + 1) % sparse_step == 0 for i in range(layers))
        linear = "linear_attention" in types
        return dataclasses.replace(
            base, architecture=arch, qkv_bias=bool(text.get("attention_bias", False)),
            layer_types=types, gated_attention=flags["gated_attention"],
            zero_centred_norm=flags["zero_centred_norm"], fused_linear_proj=flags["fused_linear_proj"],
            linear_num_key_heads=int(text["linear_num_key_heads"]) if linear else 0,
            linear_num_value_heads=int(text["linear_num_value_heads"]) if linear else 0,
            linear_key_head_dim=int(text["linear_key_head_dim"]) if linear else 0,
            linear_value_head_dim=int(text["linear_value_head_dim"]) if linear else 0,
            linear_conv_kernel_dim=int(text.get("linear_conv_kernel_dim", 4)) if linear else 0,
            num_experts=experts,
            num_experts_per_tok=int(text["num_experts_per_tok"]) if experts else 0,
            moe_intermediate_size=int(text["moe_intermediate_size"]) if experts else 0,
            shared_expert_intermediate_size=(int(text.get("shared_expert_intermediate_size") or 0)
                                             if experts and flags["shared_expert"] else 0),
            norm_topk_prob=arch in _ALWAYS_NORM_TOPK or bool(text.get("norm_topk_prob", False)),
            moe_layers=moe)
    except KeyError as e:
        raise ModelConfigError(f"{source}: required key {e.args[0]!r} is missing") from None
    except (TypeError, ValueError) as e:
        if isinstance(e, ModelConfigError):
            raise
        raise ModelConfigError(f"{source}: {e}") from None
