"""Write tiny GGUF files from tiny random HF checkpoints, the way llama.cpp's converter lays them out.

Weights are quantized with `gguf.quants.quantize` (QUANT_TYPES; "Q5_K", which it cannot encode,
gets random blocks with sane scales); 1-D tensors stay F32
as llama.cpp keeps them. llama's q/k rows are stored in llama.cpp's permuted rotary order. The
checkpoint's byte-level BPE goes in as token list, merges and token types, padded with `[PADn]`
tokens up to the model's vocab size as llama.cpp does.
"""
from __future__ import annotations

import functools
import json
from pathlib import Path

import gguf
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter, TokenType, quants
from safetensors.numpy import load_file

from tiny_models import CHAT_TEMPLATE, make_checkpoint

QUANT_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")

@functools.lru_cache(maxsize=None)
def _name_map(arch: str, layers: int) -> gguf.TensorNameMap:
    return gguf.get_tensor_name_map(next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch), layers)


def gguf_name(arch: str, layers: int, hf_name: str) -> str:
    """The GGUF name llama.cpp's converter gives an HF tensor: the gguf package's name map for `arch`."""
    return _name_map(arch, layers).get_name(hf_name, try_suffixes=(".weight", ".bias"))


def llama_cpp_permute(rows: np.ndarray, heads: int) -> np.ndarray:
    """convert_hf_to_gguf's rotary row order: each head's two halves interleaved pair by pair."""
    return (rows.reshape(heads, 2, rows.shape[0] // heads // 2, *rows.shape[1:])
            .swapaxes(1, 2).reshape(rows.shape))


def _add_tokenizer(writer: GGUFWriter, checkpoint: Path, vocab_size: int, pre: str) -> None:
    tokenizer = json.loads((checkpoint / "tokenizer.json").read_text(encoding="utf-8"))
    by_id = {i: tok for tok, i in tokenizer["model"]["vocab"].items()}
    special = {t["content"] for t in tokenizer["added_tokens"] if t["special"]}
    tokens = [by_id.get(i, f"[PAD{i}]") for i in range(vocab_size)]
    types = [TokenType.UNUSED if i not in by_id else TokenType.CONTROL if tok in special else TokenType.NORMAL
             for i, tok in enumerate(tokens)]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tokenizer["model"]["merges"]]
    config = json.loads((checkpoint / "config.json").read_text())
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_eos_token_id(config["eos_token_id"])
    writer.add_bos_token_id(config["pad_token_id"])
    writer.add_pad_token_id(config["pad_token_id"])
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)


def _add_tensor(writer: GGUFWriter, name: str, values: np.ndarray, qtype: str) -> None:
    values = values.astype(np.float32)
    if values.ndim == 1 or qtype == "F32":
        writer.add_tensor(name, values)
    elif qtype == "F16":
        writer.add_tensor(name, values.astype(np.float16))
    elif qtype == "Q5_K":
        writer.add_tensor(name, _random_q5_k(values.shape, seed=len(name)), raw_dtype=GGMLQuantizationType.Q5_K)
    else:
        kind = GGMLQuantizationType[qtype]
        writer.add_tensor(name, quants.quantize(values, kind), raw_dtype=kind)


def _random_q5_k(shape: tuple[int, int], seed: int) -> np.ndarray:
    """Q5_K blocks of random bytes whose leading f16 d/dmin are small, so values stay near +-0.2:
    any bits are a valid Q5_K block, and both dequantizers must read them the same way."""
    rows, cols = shape
    block_values, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType.Q5_K]
    blocks = np.random.default_rng(seed).integers(0, 256, (rows * cols // block_values, block_bytes), np.uint8)
    blocks[:, :4] = np.array([1e-4, 1e-4], np.float16).view(np.uint8)
    return blocks.reshape(rows, -1)


def write_gguf(directory: Path, arch: str, qtype: str, *, tied: bool = False, pre: str = "qwen2",
               head_dim: int = 32, hidden: int = 64, intermediate: int = 128, seed: int = 0,
               rope_scaling: dict | None = None) -> Path:
    """`<directory>/<arch>-<qtype>.gguf` from a fresh `make_checkpoint(directory / "hf", ...)`; `rope_scaling`
    (rope_type linear or yarn, factor, original_max_position_embeddings) written as the converter writes a
    config.json's."""
    directory = Path(directory)
    checkpoint = make_checkpoint(directory / f"hf-{arch}-{qtype}", arch, tied=tied, head_dim=head_dim,
                                 hidden=hidden, intermediate=intermediate, seed=seed)
    config = json.loads((checkpoint / "config.json").read_text())
    weights = load_file(str(checkpoint / "model.safetensors"))
    path = directory / f"{arch}-{qtype}.gguf"
    writer = GGUFWriter(path, arch)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])
    writer.add_rope_dimension_count(config["head_dim"])
    writer.add_rope_freq_base(config.get("rope_theta") or config["rope_parameters"]["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    if rope_scaling:
        writer.add_rope_scaling_type(gguf.RopeScalingType(rope_scaling["rope_type"]))
        writer.add_rope_scaling_factor(rope_scaling["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope_scaling["original_max_position_embeddings"])
    _add_tokenizer(writer, checkpoint, config["vocab_size"], pre)
    heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}
    for name, values in weights.items():
        if name == "lm_head.weight" and tied:
            continue
        module = name.split(".")[-2]
        if arch == "llama" and module in heads:
            values = llama_cpp_permute(values, heads[module])
        _add_tensor(writer, gguf_name(arch, config["num_hidden_layers"], name), values, qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
