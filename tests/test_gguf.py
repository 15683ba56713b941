"""GGUF -> HF dir conversion, checked against transformers loading the same GGUF file (the oracle)."""
from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging as hf_logging

import engine.loading.gguf as gguf_module
import engine.loading.gguf_weights as gguf_weights
from engine.loading.gguf import GGUFError, gguf_to_hf_dir
from engine.loading.model_config import parse_model_config
from gguf_writer import QUANT_TYPES, write_gguf
from tiny_models import special_token_id

# the project's shared test inputs sit beside the checkout (../shared), in CI as here
SHARED = Path(__file__).resolve().parents[2] / "shared" / "testdata" / "gguf"
SHARED_FILES = sorted(SHARED.glob("*.gguf"))
assert SHARED_FILES, f"no GGUF test files in {SHARED}: the checkout needs ../shared beside it"
# transformers' GGUF loader derives head_dim itself (qwen2: hidden/heads, qwen3: 128), so the
# written files use those; llama reads it from the file, so it gets a non-default one.
HEAD_DIMS = {"qwen2": 16, "qwen3": 128, "llama": 32}
TEXT = ("Hello World! The quick brown fox... Größere Modelle, schöne Grüße aus München.\n"
        "敏捷的棕色狐狸跳过了懒狗。你好，世界！\n"
        "def f(x: int) -> int:\n    return x ** 2  # square\n\n\n"
        "Numbers 0 7 42 2024 3.14159 1234567 and emoji 🙂🚀✓ →   spaces\t\ttabs  \n"
        "<|im_start|>user\nhi<|im_end|>\n")
TIED_TYPES = {"F16", "Q8_0", "Q4_1", "Q5_1"}  # written without an `output` tensor
IDS = torch.tensor([[5, 17, 200, 3, 99, 250, 41, 1, 255, 77]])  # below every vocab size here

hf_logging.set_verbosity_error()


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """(arch, qtype) -> GGUF path, every architecture in every writable type (even ones tied)."""
    root = tmp_path_factory.mktemp("gguf-written")
    return {(arch, q): write_gguf(root / f"{arch}-{q}", arch, q, head_dim=HEAD_DIMS[arch], tied=q in TIED_TYPES)
            for arch in HEAD_DIMS for q in QUANT_TYPES}


@pytest.fixture
def cache(tmp_path):
    return tmp_path / "cache"


def _logits(directory: Path, **kwargs) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, **kwargs).eval()
    with torch.no_grad():
        return model(IDS).logits


def _converted_logits(directory: Path) -> torch.Tensor:
    """Our dir through transformers' ordinary loader, failing on any missing or unused tensor."""
    model, info = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, output_loading_info=True)
    assert not any(info.values()), info
    with torch.no_grad():
        return model.eval()(IDS).logits


def _assert_same_logits_as_transformers(path: Path, cache: Path) -> Path:
    converted = gguf_to_hf_dir(path, "float32", cache_root=cache)
    expected = _logits(path.parent, gguf_file=path.name)
    torch.testing.assert_close(_converted_logits(converted), expected, atol=1e-5, rtol=0)
    return converted


@pytest.mark.parametrize("qtype", QUANT_TYPES)
@pytest.mark.parametrize("arch", sorted(HEAD_DIMS))
def test_written_file_matches_transformers(written, cache, arch, qtype):
    converted = _assert_same_logits_as_transformers(written[arch, qtype], cache)
    assert json.loads((converted / "config.json").read_text())["tie_word_embeddings"] == (qtype in TIED_TYPES)


def test_q5_k_file_matches_transformers(tmp_path, cache):
    """Q5_K rows hold 256 values, so this model is wider: hidden 256, 4 heads of 64."""
    path = write_gguf(tmp_path, "llama", "Q5_K", head_dim=64, hidden=256, intermediate=512)
    _assert_same_logits_as_transformers(path, cache)


@pytest.mark.parametrize("path", SHARED_FILES, ids=lambda p: p.name)
def test_k_quant_file_matches_transformers(path, cache):
    converted = _assert_same_logits_as_transformers(path, cache)
    config = json.loads((converted / "config.json").read_text())
    assert config["tie_word_embeddings"] == ("tied" in path.name)
    if path.name.startswith("qwen3-hd128"):
        assert config["head_dim"] == 128


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_key_length_head_dim_matches_original_checkpoint(tmp_path, cache, arch):
    """head_dim 32 != hidden/heads, which transformers' GGUF path cannot read: F32 is lossless, so the
    original HF checkpoint is the oracle."""
    path = write_gguf(tmp_path, arch, "F32", head_dim=32)
    converted = gguf_to_hf_dir(path, "float32", cache_root=cache)
    expected = _logits(tmp_path / f"hf-{arch}-F32")
    torch.testing.assert_close(_converted_logits(converted), expected, atol=1e-5, rtol=0)


def test_config_and_generation_files(written, cache):
    converted = gguf_to_hf_dir(written["llama", "Q8_0"], "float32", cache_root=cache)
    config = parse_model_config(json.loads((converted / "config.json").read_text()))
    shape = (config.architecture, config.head_dim, config.num_heads, config.num_kv_heads)
    assert shape == ("LlamaForCausalLM", 32, 4, 2)
    assert config.tie_word_embeddings and config.eos_token_ids == (special_token_id("<|im_end|>"),)
    generation = json.loads((converted / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [special_token_id("<|im_end|>"), special_token_id("<|endoftext|>")]
    tokenizer_config = json.loads((converted / "tokenizer_config.json").read_text())
    assert tokenizer_config["eos_token"] == "<|im_end|>" and "<|im_start|>" in tokenizer_config["chat_template"]


def test_bfloat16_entry_is_rounded_float32(written, cache):
    path = written["qwen3", "Q4_0"]
    full = load_file(str(gguf_to_hf_dir(path, "float32", cache_root=cache) / "model.safetensors"))
    half_dir = gguf_to_hf_dir(path, "bfloat16", cache_root=cache)
    half = load_file(str(half_dir / "model.safetensors"))
    assert half_dir != gguf_to_hf_dir(path, "float32", cache_root=cache)
    assert half.keys() == full.keys()
    for name, tensor in half.items():
        assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, full[name].to(torch.bfloat16)), name


def test_shards_row_bands_and_progress(written, cache, monkeypatch):
    monkeypatch.setattr(gguf_weights, "SHARD_BYTES", 64 * 1024)
    monkeypatch.setattr(gguf_weights, "DEQUANT_BAND_ELEMENTS", 1000)  # 15-row bands, a short last one
    seen = []
    path = written["qwen2", "Q8_0"]
    converted = gguf_to_hf_dir(path, "float32", cache_root=cache, progress=lambda *a: seen.append(a))
    index = json.loads((converted / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1 and not (converted / "model.safetensors").exists()
    total = len(gguf.GGUFReader(path).tensors)
    assert [s[:2] for s in seen] == [(i, total) for i in range(1, total + 1)]
    torch.testing.assert_close(_converted_logits(converted), _logits(path.parent, gguf_file=path.name),
                               atol=1e-5, rtol=0)


def _encode_both(path: Path, cache: Path) -> tuple[list[int], list[int]]:
    ours = Tokenizer.from_file(str(gguf_to_hf_dir(path, "float32", cache_root=cache) / "tokenizer.json"))
    theirs = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return ours.encode(TEXT).ids, theirs(TEXT, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("pre", ["qwen2", "llama-bpe", "gpt2"])
def test_tokenizer_matches_transformers(tmp_path, cache, pre):
    ours, theirs = _encode_both(write_gguf(tmp_path, "qwen2", "F32", head_dim=16, pre=pre), cache)
    assert ours == theirs
    assert special_token_id("<|im_start|>") in ours


@pytest.mark.parametrize("path", SHARED_FILES[:1], ids=lambda p: p.name)
def test_shared_tokenizer_matches_transformers(path, cache):
    ours, theirs = _encode_both(path, cache)
    assert ours == theirs


def test_smollm_splits_every_digit(tmp_path, cache):
    path = write_gguf(tmp_path, "qwen2", "F32", head_dim=16, pre="smollm")
    tokenizer = Tokenizer.from_file(str(gguf_to_hf_dir(path, "float32", cache_root=cache) / "tokenizer.json"))
    encoding = tokenizer.encode("year 2024, pi 3.14159, 100 items")
    digit_tokens = [t for t in encoding.tokens if any(c.isdigit() for c in t)]
    assert digit_tokens == list("2024" "3" "14159" "100")
    assert tokenizer.decode(encoding.ids) == "year 2024, pi 3.14159, 100 items"


def test_warm_call_neither_dequantizes_nor_hashes(written, cache, monkeypatch):
    path = written["qwen2", "Q4_0"]
    first = gguf_to_hf_dir(path, "float32", cache_root=cache)

    def fail(*args, **kwargs):
        raise AssertionError("a warm call must not do this")
    monkeypatch.setattr(gguf.quants, "dequantize", fail)
    monkeypatch.setattr(gguf_module.hashlib, "sha256", fail)
    assert gguf_to_hf_dir(path, "float32", cache_root=cache) == first


@pytest.mark.parametrize("damage", ["delete weights", "delete marker", "truncate weights"])
def test_damaged_entry_is_rebuilt(written, cache, monkeypatch, damage):
    path = written["llama", "Q4_1"]
    entry = gguf_to_hf_dir(path, "float32", cache_root=cache)
    expected = _converted_logits(entry)
    if damage == "delete weights":
        (entry / "model.safetensors").unlink()
    elif damage == "delete marker":
        (entry / "complete.json").unlink()
    else:
        with open(entry / "model.safetensors", "r+b") as f:
            f.truncate(100)
    calls = []
    real = gguf.quants.dequantize
    monkeypatch.setattr(gguf.quants, "dequantize", lambda *a: calls.append(1) or real(*a))
    assert gguf_to_hf_dir(path, "float32", cache_root=cache) == entry
    assert calls and (entry / "complete.json").exists()
    torch.testing.assert_close(_converted_logits(entry), expected, atol=0, rtol=0)
    assert [p.name for p in cache.iterdir() if p.name.startswith(".")] == []


def _tiny_file(path: Path, arch: str, tensors: dict[str, np.ndarray], raw: dict | None = None,
               hidden: int | None = None) -> Path:
    """One block; with `hidden`, the metadata a config needs too."""
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(1)
    if hidden:
        writer.add_embedding_length(hidden)
        writer.add_head_count(2)
        writer.add_feed_forward_length(hidden)
        writer.add_context_length(64)
        writer.add_layer_norm_rms_eps(1e-6)
    for name, values in tensors.items():
        writer.add_tensor(name, values, raw_dtype=(raw or {}).get(name))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_not_a_gguf_file(tmp_path, cache):
    path = tmp_path / "notes.gguf"
    path.write_text("not a model")
    with pytest.raises(GGUFError, match=r"notes\.gguf: not a readable GGUF file"):
        gguf_to_hf_dir(path, cache_root=cache)
    with pytest.raises(GGUFError, match=r"missing\.gguf: no such GGUF file"):
        gguf_to_hf_dir(tmp_path / "missing.gguf", cache_root=cache)


def test_unsupported_architecture(tmp_path, cache):
    path = _tiny_file(tmp_path / "m.gguf", "gemma", {"token_embd.weight": np.zeros((8, 32), np.float32)})
    with pytest.raises(GGUFError, match=r"m\.gguf: architecture 'gemma' is not supported; supported: .*qwen3"):
        gguf_to_hf_dir(path, cache_root=cache)


def test_unsupported_tensor_type_and_name(tmp_path, cache):
    q2k = gguf.GGMLQuantizationType.Q2_K
    embed = np.zeros((8, gguf.GGML_QUANT_SIZES[q2k][1]), np.uint8)  # 8 rows of one 256-value block
    path = _tiny_file(tmp_path / "q2k.gguf", "qwen2", {"token_embd.weight": embed}, {"token_embd.weight": q2k})
    with pytest.raises(GGUFError, match=r"q2k\.gguf: tensor 'token_embd.weight' has type Q2_K.*supported: .*Q4_K"):
        gguf_to_hf_dir(path, cache_root=cache)
    tensors = {"token_embd.weight": np.zeros((8, 32), np.float32), "rope_freqs.weight": np.ones(16, np.float32)}
    path = _tiny_file(tmp_path / "rope.gguf", "llama", tensors, hidden=32)
    with pytest.raises(GGUFError, match=r"rope\.gguf: tensor 'rope_freqs.weight' is not part of a supported llama "
                                        r"model \(known: blk\.N\.attn_k\.weight, .*, token_embd\.weight\)"):
        gguf_to_hf_dir(path, cache_root=cache)
    path = _tiny_file(tmp_path / "bare.gguf", "llama", {"token_embd.weight": tensors["token_embd.weight"]}, hidden=32)
    with pytest.raises(GGUFError, match=r"bare\.gguf: tensor 'output_norm\.weight' is missing"):
        gguf_to_hf_dir(path, cache_root=cache)
    with pytest.raises(GGUFError, match=r"dtype 'int8'.*'bfloat16'"):
        gguf_to_hf_dir(path, "int8", cache_root=cache)
    assert [p.name for p in cache.iterdir() if p.is_dir()] == []
