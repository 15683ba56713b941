"""Tiny random Hugging Face checkpoints (and their tokenizer) for tests: the oracle's own format.

`make_checkpoint` writes a directory exactly as `save_pretrained` would for a real Qwen3 / Qwen2 /
Llama model, with weights re-initialised at std ~0.15 so greedy output varies (the HF default 0.02
makes tiny models repeat one token). `hf_model` loads such a directory back into transformers.
"""
from __future__ import annotations

import functools
import json
from pathlib import Path

import torch

from ops.quant_weight import QuantizedWeight

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
TOKENIZER_VOCAB = 500

# Mixed English / code / German / Chinese so merges cover ASCII words while most CJK characters stay
# split into their UTF-8 bytes: decoding then has to cope with characters spread over tokens.
TRAINING_TEXT = """\
The quick brown fox jumps over the lazy dog. A paged cache keeps the keys and values of every
request in fixed-size blocks, so many users can share one model without wasting memory.
Continuous batching lets new requests join a running batch at any step; finished ones leave at once.
def generate(prompt: str, max_tokens: int = 16) -> str:
    tokens = tokenizer.encode(prompt)
    for step in range(max_tokens):
        logits = model(tokens)[-1]
        tokens.append(int(logits.argmax()))
    return tokenizer.decode(tokens)
for (int i = 0; i < n; ++i) { sum += x[i] * y[i]; }  // dot product
Der schnelle braune Fuchs springt über den faulen Hund. Größere Modelle brauchen mehr Speicher,
aber die Antworten werden besser. Schöne Grüße aus München!
敏捷的棕色狐狸跳过了懒狗。模型把每个请求的键和值保存在固定大小的块中。
我们今天学习语言模型，明天继续。你好，世界！
Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 2024 3.14159 -7 1e-6
Emoji and symbols: 🙂 🚀 ✓ → « » € £ ¥ © — …
"""

# Qwen2.5's ChatML template without the tool-calling branches.
CHAT_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}\n"
    "    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n"
    "{%- else %}\n"
    "    {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}\n"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    "    {%- if message.role != 'system' or not loop.first %}\n"
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n"
)


@functools.lru_cache(maxsize=1)
def _trained_tokenizer_json() -> str:
    """Train once per process; every checkpoint gets a copy of the same tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(TRAINING_TEXT.splitlines(keepends=True), trainer=trainer)
    return tok.to_str()


def tokenizer_size() -> int:
    return len(json.loads(_trained_tokenizer_json())["model"]["vocab"])


def special_token_id(token: str) -> int:
    vocab = json.loads(_trained_tokenizer_json())["model"]["vocab"]
    return vocab[token]


def build_tokenizer(directory: str | Path) -> Path:
    """Write tokenizer.json + tokenizer_config.json (ChatML template) into `directory`."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "tokenizer.json").write_text(_trained_tokenizer_json(), encoding="utf-8")
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "model_max_length": 512,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    return directory


_ARCHITECTURES = {"qwen3": "Qwen3ForCausalLM", "qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM"}


def _config(arch: str, **kwargs):
    import transformers

    if arch not in _ARCHITECTURES:
        raise ValueError(f"arch {arch!r}: choose one of {sorted(_ARCHITECTURES)}")
    name = _ARCHITECTURES[arch]
    config_class = getattr(transformers, name.replace("ForCausalLM", "Config"))
    extra = {"attention_bias": False} if arch == "llama" else {}
    return getattr(transformers, name), config_class(**kwargs, **extra)


def _randomise(model: torch.nn.Module, seed: int) -> None:
    """std 0.15 weights, norm scales near 1, so a 2-layer model still produces varied text."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen, dtype=torch.float32)
            if "norm" in name:
                value = 1.0 + 0.1 * noise
            else:
                value = 0.15 * noise
            param.copy_(value.to(param.dtype))


def make_checkpoint(
    directory: str | Path,
    arch: str = "qwen3",
    *,
    tied: bool = True,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 32,
    intermediate: int = 128,
    vocab: int | None = None,
    max_pos: int = 512,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """Write a random HF checkpoint dir (config, safetensors, tokenizer, generation config)."""
    directory = Path(directory)
    im_end, endoftext = special_token_id("<|im_end|>"), special_token_id("<|endoftext|>")
    if vocab is None:
        vocab = -(-tokenizer_size() // 64) * 64
    model_class, config = _config(
        arch,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=max_pos,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tied,
        bos_token_id=None,
        eos_token_id=im_end,
        pad_token_id=endoftext,
    )
    model = model_class(config).to(dtype)
    _randomise(model, seed)
    model.save_pretrained(directory, safe_serialization=True)
    build_tokenizer(directory)
    generation = {"eos_token_id": [im_end, endoftext], "pad_token_id": endoftext, "bos_token_id": None}
    (directory / "generation_config.json").write_text(json.dumps(generation, indent=2))
    return directory


def hf_model(path: str | Path):
    """The transformers model for a checkpoint dir, fp32 and in eval mode: the oracle."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    return model.eval()



# ---------------------------------------------------------------- hybrid / MoE checkpoints

# arch -> (transformers model class, config class); "qwen3_5_vl" is a real Qwen3.5 release layout:
# Qwen3_5ForConditionalGeneration, text config under `text_config`, text weights under model.language_model.*
HYBRID_ARCHITECTURES = {
    "qwen3_5": ("Qwen3_5ForCausalLM", "Qwen3_5TextConfig"),
    "qwen3_next": ("Qwen3NextForCausalLM", "Qwen3NextConfig"),
    "qwen3_5_moe": ("Qwen3_5MoeForCausalLM", "Qwen3_5MoeTextConfig"),
    "qwen3_moe": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig"),
    "qwen3_5_vl": ("Qwen3_5ForConditionalGeneration", "Qwen3_5TextConfig"),
}
_ZERO_CENTRED = ("qwen3_5", "qwen3_next", "qwen3_5_moe", "qwen3_5_vl")


def _randomise_hybrid(model: torch.nn.Module, seed: int, zero_centred: bool) -> None:
    """Like _randomise; (1 + weight) norms get weights near 0 so their scale is near 1 too. The gated
    norm inside linear attention (`linear_attn.norm`) is a plain scale."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen, dtype=torch.float32)
            if "norm" in name and zero_centred and "linear_attn.norm" not in name:
                value = 0.1 * noise
            elif "norm" in name:
                value = 1.0 + 0.1 * noise
            else:
                value = 0.15 * noise
            param.copy_(value.to(param.dtype))


def make_hybrid_checkpoint(
    directory: str | Path,
    arch: str = "qwen3_5",
    *,
    tied: bool = False,
    hidden: int = 64,
    layer_types: tuple[str, ...] = ("linear_attention", "full_attention", "linear_attention", "full_attention"),
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 16,
    linear_heads: tuple[int, int] = (2, 4),     # (key heads, value heads)
    linear_dims: tuple[int, int] = (16, 8),     # (key head dim, value head dim)
    intermediate: int = 96,
    experts: int = 4,
    top_k: int = 2,
    moe_intermediate: int = 32,
    shared_intermediate: int = 48,
    mlp_only_layers: tuple[int, ...] = (0,),
    vocab: int | None = None,
    max_pos: int = 512,
    seed: int = 0,
    embed_scale: float = 1.0,
) -> Path:
    """Write a random checkpoint of a hybrid (Gated DeltaNet + gated attention) or MoE architecture.
    `mlp_only_layers`: Qwen3-Next's layers with a dense MLP (llama.cpp's qwen3next has none).
    `embed_scale` (with `tied`) scales the embeddings up: the residual stream then leans towards the
    current token, so greedy output runs in repeats that n-gram lookup proposes and sometimes leaves."""
    import transformers

    if arch not in HYBRID_ARCHITECTURES:
        raise ValueError(f"arch {arch!r}: choose one of {sorted(HYBRID_ARCHITECTURES)}")
    directory = Path(directory)
    im_end, endoftext = special_token_id("<|im_end|>"), special_token_id("<|endoftext|>")
    vocab = vocab or -(-tokenizer_size() // 64) * 64
    model_name, config_name = HYBRID_ARCHITECTURES[arch]
    kwargs = dict(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=len(layer_types),
                  num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                  max_position_embeddings=max_pos, rms_norm_eps=1e-6, tie_word_embeddings=tied,
                  bos_token_id=None, eos_token_id=im_end, pad_token_id=endoftext)
    if arch == "qwen3_moe":
        kwargs.update(intermediate_size=intermediate, num_experts=experts, num_experts_per_tok=top_k,
                      moe_intermediate_size=moe_intermediate, norm_topk_prob=bool(seed % 2))
    else:
        kwargs.update(layer_types=list(layer_types), linear_num_key_heads=linear_heads[0],
                      linear_num_value_heads=linear_heads[1], linear_key_head_dim=linear_dims[0],
                      linear_value_head_dim=linear_dims[1], linear_conv_kernel_dim=4,
                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                       "partial_rotary_factor": 0.25})
        if arch in ("qwen3_next", "qwen3_5_moe"):
            kwargs.update(num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=moe_intermediate,
                          shared_expert_intermediate_size=shared_intermediate)
        if arch != "qwen3_5_moe":
            kwargs.update(intermediate_size=intermediate)
        if arch == "qwen3_next":    # by default layer 0 keeps a dense MLP: mlp_only_layers must be honoured
            kwargs.update(mlp_only_layers=list(mlp_only_layers), norm_topk_prob=True)
    text_config = getattr(transformers, config_name)(**kwargs)
    if arch == "qwen3_5_vl":
        vision = dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=hidden,
                      patch_size=2, spatial_merge_size=1, temporal_patch_size=1)
        config = transformers.Qwen3_5Config(text_config=text_config.to_dict(), vision_config=vision,
                                            tie_word_embeddings=tied)
    else:
        config = text_config
    model = getattr(transformers, model_name)(config)
    _randomise_hybrid(model, seed, arch in _ZERO_CENTRED)
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(embed_scale)
    model.save_pretrained(directory, safe_serialization=True)
    if arch == "qwen3_5_vl":
        # as in the real releases: only the top level says whether the embeddings are tied
        file = directory / "config.json"
        saved = json.loads(file.read_text())
        saved["text_config"].pop("tie_word_embeddings", None)
        file.write_text(json.dumps(saved, indent=2))
    build_tokenizer(directory)
    generation = {"eos_token_id": [im_end, endoftext], "pad_token_id": endoftext, "bos_token_id": None}
    (directory / "generation_config.json").write_text(json.dumps(generation, indent=2))
    return directory


def hf_hybrid_model(path: str | Path):
    """The transformers oracle for a hybrid checkpoint dir, fp32, eval mode. For a multimodal Qwen3.5
    checkpoint, AutoModelForCausalLM ignores the top-level `tie_word_embeddings` (KNOWN-TRAPS): copy it
    into text_config so the oracle's lm_head is the one the checkpoint means."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path)
    if hasattr(config, "text_config"):
        config.text_config.tie_word_embeddings = config.tie_word_embeddings
    model = AutoModelForCausalLM.from_pretrained(path, config=config, dtype=torch.float32,
                                                 attn_implementation="eager")
    return model.eval()


def whole_prompt_batch(ids, first_block: int = 1, block_size: int = 16):
    """One sequence prefilled in one step into consecutive K/V blocks from `first_block`, with logits
    at every position: how the tests compare a model's logits with transformers' full forward."""
    from engine.models.batch import ForwardBatch

    t = ids.numel()
    blocks = -(-t // block_size)
    return ForwardBatch(
        input_ids=ids, positions=torch.arange(t), slot_mapping=torch.arange(t) + first_block * block_size,
        block_tables=torch.arange(first_block, first_block + blocks, dtype=torch.int32)[None],
        query_start_loc=torch.tensor([0, t], dtype=torch.int32),
        context_lens=torch.tensor([t], dtype=torch.int32), logits_indices=torch.arange(t))


class StoredWeights:
    """The part of a Checkpoint that LinearLoader reads, over weights given per name."""

    def __init__(self, weights: dict):
        self.weights = weights

    def is_quantized(self, name: str) -> bool:
        return isinstance(self.weights[name], QuantizedWeight)

    def get_linear(self, name: str, shape, dtype):
        return self.weights[name]
