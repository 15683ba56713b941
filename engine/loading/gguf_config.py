"""A GGUF file's metadata -> the Hugging Face config.json our loader reads (engine/loading/model_config.py).

Keys go by their `gguf.Keys` names. Gated DeltaNet layers are described by the `ssm.*` keys llama.cpp's
converter writes (conv_kernel; state_size = key head dim; group_count = key heads; time_step_rank = value
heads; inner_size = value heads x value head dim). Its MTP blocks (`nextn_predict_layers`) follow the
decoder's layers and are not part of the served model.
"""
from __future__ import annotations

from gguf import Keys

# GGUF `general.architecture` -> (HF architecture, HF model_type)
ARCHITECTURES = {
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen3moe": ("Qwen3MoeForCausalLM", "qwen3_moe"),
    "qwen3next": ("Qwen3NextForCausalLM", "qwen3_next"),
    "qwen35": ("Qwen3_5ForCausalLM", "qwen3_5_text"),
    "qwen35moe": ("Qwen3_5MoeForCausalLM", "qwen3_5_moe_text"),
}
TOKEN_EMBD = "token_embd.weight"
OUTPUT = "output.weight"
# The converter's per-layer recurrent flags (MTP blocks included); the gguf 0.19 package has no name for
# the key yet. Files without it give full_attention_interval, which the converter writes as 4 whatever the
# checkpoint's layer_types said.
RECURRENT_LAYERS = getattr(Keys.Attention, "RECURRENT_LAYERS", "{arch}.attention.recurrent_layers")


class GGUFContentError(ValueError):
    """A key or tensor of the file cannot be converted; the message names it (gguf.py adds the file's name)."""


def _rope_scaling(key, arch: str) -> dict:
    """The rope-parameter keys of the file's rope scaling, as convert_hf_to_gguf.py writes it from a
    config.json's: a type, the factor, the trained context, yarn's ramp."""
    kind = key(Keys.Rope.SCALING_TYPE, None)
    if kind in (None, "none"):
        return {}
    if kind not in ("linear", "yarn"):
        raise GGUFContentError(f"{arch}.rope.scaling.type={kind!r} is not supported (none, linear or yarn)")
    if float(key(Keys.Rope.SCALING_ATTN_FACTOR, 1.0)) != 1.0:   # llama.cpp's extra factor: no config.json key
        raise GGUFContentError(f"{arch}.rope.scaling.attn_factor is not supported")
    params = {"rope_type": kind, "factor": float(key(Keys.Rope.SCALING_FACTOR))}
    for name, template in (("original_max_position_embeddings", Keys.Rope.SCALING_ORIG_CTX_LEN),
                           ("beta_fast", Keys.Rope.SCALING_YARN_BETA_FAST),
                           ("beta_slow", Keys.Rope.SCALING_YARN_BETA_SLOW)):
        if key(template, None) is not None:
            params[name] = key(template)
    return params


def hf_config(meta: dict, arch: str, shapes: dict[str, tuple[int, ...]], dtype: str) -> dict:
    """config.json for a file of `arch` with metadata `meta` and tensors `shapes` (GGUF name -> HF-order shape)."""
    def key(template: str, *default):
        name = template.format(arch=arch)
        if name in meta:
            return meta[name]
        if default:
            return default[0]
        raise GGUFContentError(f"metadata key {name!r} is missing")

    if TOKEN_EMBD not in shapes:
        raise GGUFContentError(f"tensor {TOKEN_EMBD!r} is missing")
    hidden, heads = int(key(Keys.LLM.EMBEDDING_LENGTH)), int(key(Keys.Attention.HEAD_COUNT))
    head_dim = int(key(Keys.Attention.KEY_LENGTH, hidden // heads))
    rope = {"rope_type": "default", "rope_theta": float(key(Keys.Rope.FREQ_BASE, 10000.0)),
            "partial_rotary_factor": int(key(Keys.Rope.DIMENSION_COUNT, head_dim)) / head_dim}
    rope.update(_rope_scaling(key, arch))
    sections = key(Keys.Rope.DIMENSION_SECTIONS, None)
    if sections is not None:
        # Qwen3.5's interleaved M-RoPE: with text positions in every section it is plain rotary
        rope.update(mrope_section=list(sections[:3]), mrope_interleaved=True)
    experts = int(key(Keys.LLM.EXPERT_COUNT, 0))
    layers = int(key(Keys.LLM.BLOCK_COUNT)) - int(key(Keys.LLM.NEXTN_PREDICT_LAYERS, 0))
    architecture, model_type = ARCHITECTURES[arch]
    config = {
        "architectures": [architecture],
        "model_type": model_type,
        "hidden_size": hidden,
        # Qwen3.5-MoE files have none: every MLP is sparse
        "intermediate_size": int(key(Keys.LLM.FEED_FORWARD_LENGTH, *([0] if experts else []))),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": int(key(Keys.Attention.HEAD_COUNT_KV, heads)),
        "head_dim": head_dim,
        "rms_norm_eps": float(key(Keys.Attention.LAYERNORM_RMS_EPS)),
        "rope_parameters": rope,
        "max_position_embeddings": int(key(Keys.LLM.CONTEXT_LENGTH)),
        "vocab_size": shapes[TOKEN_EMBD][0],
        "tie_word_embeddings": OUTPUT not in shapes,
        "hidden_act": "silu",
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "torch_dtype": dtype,
    }
    if arch == "qwen2":     # Qwen2 always has q/k/v biases; the others say so in their config
        config["use_sliding_window"] = False
    else:
        config["attention_bias"] = any(name.endswith(".attn_q.bias") for name in shapes)
        config["mlp_bias"] = False
    if key(Keys.SSM.CONV_KERNEL, None) is not None:
        value_heads = int(key(Keys.SSM.TIME_STEP_RANK))
        recurrent = key(RECURRENT_LAYERS, None)
        if recurrent is None:
            interval = int(key(Keys.LLM.FULL_ATTENTION_INTERVAL))
            recurrent = [(i + 1) % interval != 0 for i in range(layers)]
        config.update(layer_types=["linear_attention" if r else "full_attention" for r in recurrent[:layers]],
                      linear_conv_kernel_dim=int(key(Keys.SSM.CONV_KERNEL)),
                      linear_key_head_dim=int(key(Keys.SSM.STATE_SIZE)),
                      linear_num_key_heads=int(key(Keys.SSM.GROUP_COUNT)),
                      linear_num_value_heads=value_heads,
                      linear_value_head_dim=int(key(Keys.SSM.INNER_SIZE)) // value_heads)
    if experts:
        # llama.cpp's graphs for these architectures always renormalise the chosen experts' weights
        config.update(num_experts=experts, num_experts_per_tok=int(key(Keys.LLM.EXPERT_USED_COUNT)),
                      moe_intermediate_size=int(key(Keys.LLM.EXPERT_FEED_FORWARD_LENGTH)), norm_topk_prob=True,
                      shared_expert_intermediate_size=int(key(Keys.LLM.EXPERT_SHARED_FEED_FORWARD_LENGTH, 0)))
    return config
