"""A GGUF file's tokenizer metadata -> tokenizer.json, tokenizer_config.json, generation_config.json.

Only llama.cpp's byte-level BPE (`tokenizer.ggml.model == "gpt2"`) is supported: that is what every
Qwen, Llama-3 and SmolLM file carries. `tokenizer.ggml.pre` names the split rule the merges were
learned with; a wrong one silently changes token ids, so an unknown name is an error, not a guess.
"""
from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from engine.loading.tokenizer import byte_alphabet

# llama.cpp token_type values
CONTROL, USER_DEFINED = 3, 4

# Qwen2's split: single digits, letters with one leading non-letter, punctuation runs.
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Llama 3's split: like Qwen2's but digits in groups of up to three.
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_REGEX_SPLITS = {"qwen2": QWEN2_SPLIT, "deepseek-r1-qwen": QWEN2_SPLIT,
                 "llama-bpe": LLAMA3_SPLIT, "llama3": LLAMA3_SPLIT}
# Llama 3's tokenizer.json (and llama.cpp) take a split piece that is itself a token whole
_IGNORE_MERGES = {"llama-bpe", "llama3"}
# pre names that use GPT-2's own split (ByteLevel's built-in regex); smollm also splits every digit
_GPT2_STYLE = {"gpt2": False, "default": False, "smollm": True}
SUPPORTED_PRE = sorted([*_REGEX_SPLITS, *_GPT2_STYLE])

# end-of-turn tokens that stop generation besides the file's eos id
_STOP_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|eom_id|>")


class GGUFTokenizerError(ValueError):
    """The tokenizer metadata cannot be turned into a tokenizer; the message names the key and value."""


def _pre_tokenizer(pre: str):
    if pre in _REGEX_SPLITS:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_REGEX_SPLITS[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    if pre in _GPT2_STYLE:
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        if _GPT2_STYLE[pre]:
            return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
        return byte_level
    raise GGUFTokenizerError(f"tokenizer.ggml.pre={pre!r} is not supported; supported: {SUPPORTED_PRE}")


def build_tokenizer(meta: dict) -> Tokenizer:
    """The `tokenizers` byte-level BPE the metadata describes, special tokens kept whole."""
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise GGUFTokenizerError(f"tokenizer.ggml.model={kind!r} is not supported; only 'gpt2' (byte-level BPE)")
    tokens = meta.get("tokenizer.ggml.tokens")
    merges = meta.get("tokenizer.ggml.merges")
    if not tokens or merges is None:
        raise GGUFTokenizerError("tokenizer.ggml.tokens or tokenizer.ggml.merges is missing")
    types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    alphabet = byte_alphabet()
    spelled = set(alphabet.values())
    # A token outside the byte alphabet (a literal space, say) is stored as text: spell its bytes.
    vocab = {tok if set(tok) <= spelled else "".join(alphabet[b] for b in tok.encode("utf-8")): i
             for i, tok in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    pre = meta.get("tokenizer.ggml.pre", "default")
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, ignore_merges=pre in _IGNORE_MERGES))
    if pre in ("qwen2", "deepseek-r1-qwen"):
        tokenizer.normalizer = normalizers.NFC()  # Qwen's own tokenizer.json normalizes; GGUF drops it
    tokenizer.pre_tokenizer = _pre_tokenizer(pre)
    tokenizer.decoder = decoders.ByteLevel()
    # Control tokens spelled outside the alphabet are llama.cpp mislabels that the BPE never emits.
    tokenizer.add_special_tokens([AddedToken(tok, normalized=False, special=True)
                                  for tok, kind in zip(tokens, types) if kind == CONTROL and set(tok) <= spelled])
    tokenizer.add_tokens([AddedToken(tok, normalized=False, special=False)
                          for tok, kind in zip(tokens, types) if kind == USER_DEFINED and tok in vocab])
    bos = meta.get("tokenizer.ggml.bos_token_id")
    if meta.get("tokenizer.ggml.add_bos_token") and bos is not None:
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{tokens[bos]}:0 $A:0", pair=f"{tokens[bos]}:0 $A:0 {tokens[bos]}:1 $B:1",
            special_tokens=[(tokens[bos], bos)])
    return tokenizer


def stop_token_ids(meta: dict) -> list[int]:
    """The file's eos id, then eot/eom ids and the end-of-turn tokens the vocabulary has, each once."""
    tokens = meta.get("tokenizer.ggml.tokens") or []
    ids = [meta.get(f"tokenizer.ggml.{key}_token_id") for key in ("eos", "eot", "eom")]
    position = {tok: i for i, tok in enumerate(tokens) if tok in _STOP_TOKENS}
    ids += [position[tok] for tok in _STOP_TOKENS if tok in position]
    return list(dict.fromkeys(int(i) for i in ids if i is not None))


def write_tokenizer_files(meta: dict, out: Path) -> None:
    """tokenizer.json, tokenizer_config.json (special token strings, chat template), generation_config.json."""
    tokenizer = build_tokenizer(meta)
    tokenizer.save(str(out / "tokenizer.json"))
    tokens = meta["tokenizer.ggml.tokens"]

    def token(key: str) -> str | None:
        index = meta.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[index] if index is not None and 0 <= index < len(tokens) else None

    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("bos"),
        "eos_token": token("eos"),
        "pad_token": token("padding"),
        "unk_token": token("unknown"),
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "clean_up_tokenization_spaces": False,
    }
    if meta.get("tokenizer.chat_template") is not None:
        tokenizer_config["chat_template"] = meta["tokenizer.chat_template"]
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2, ensure_ascii=False),
                                               encoding="utf-8")
    generation = {"bos_token_id": meta.get("tokenizer.ggml.bos_token_id"), "eos_token_id": stop_token_ids(meta)}
    if meta.get("tokenizer.ggml.padding_token_id") is not None:
        generation["pad_token_id"] = meta["tokenizer.ggml.padding_token_id"]
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2), encoding="utf-8")
