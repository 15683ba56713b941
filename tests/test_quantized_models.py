"""Quantized weights end to end: GGUF blocks repacked into group form (checked against the `gguf`
package's dequantizer), checkpoints quantized at load, and models run quantized against the same
model on dequantized weights."""
from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader, quants
from safetensors.torch import load_file, save_file

from engine import LLM, SamplingParams
from engine.builder import resolve_quantization
from engine.config import ConfigError, make_engine_config
from engine.loading import gguf_quant
from engine.kv.pool import KVPool, KVShape
from engine.loading.checkpoint import group_tensor_names, open_checkpoint
from engine.loading.model_config import parse_model_config
from engine.models.linear import LinearLoader, LinearParts, embedding, linear, weight_nbytes
from engine.models.qwen3 import DenseDecoder
import engine.loading.gguf as gguf_module
from engine.loading.gguf import gguf_to_hf_dir
from engine.loading.gguf_tensors import tensor_plan
from gguf_writer import write_gguf
from tiny_models import StoredWeights, whole_prompt_batch
from ops.quant_linear import quant_linear
from ops.quant_weight import QuantizedWeight, quantize_int4, quantize_int8
from test_gguf import SHARED, SHARED_FILES

K_QUANTS = (GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_K, GGMLQuantizationType.Q6_K)

PROMPTS = ["The quick brown fox", "def generate(prompt", "Der schnelle braune Fuchs springt über",
           "模型把每个请求的键和值", "hello hello hello", "1 2 3 4 5 6"]
NEW_TOKENS = 12


def _kept_tensors(path: Path):
    return [t for t in GGUFReader(path).tensors
            if t.tensor_type in gguf_quant.KEPT_TYPES and len(t.shape) == 2]


def _written_files(tmp_path_factory) -> list[Path]:
    root = tmp_path_factory.mktemp("gguf-quant")
    files = [write_gguf(root / q, "qwen2", q, head_dim=16) for q in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")]
    return files + [write_gguf(root / "Q5_K", "llama", "Q5_K", head_dim=64, hidden=256, intermediate=512)]


@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory) -> list[Path]:
    return _written_files(tmp_path_factory) + SHARED_FILES


def test_every_block_format_repacks(gguf_files):
    """Every format dequantizes to exactly the gguf package's values (Q6_K as int6, a scale per 16 values)."""
    seen = set()
    for path in gguf_files:
        for t in _kept_tensors(path):
            shape = tuple(int(d) for d in reversed(t.shape))
            data = t.data.reshape(shape[0], -1)
            q, scales, mins, supers = gguf_quant.groups(data, t.tensor_type, shape)
            weight = QuantizedWeight.from_groups(q, scales, mins, gguf_quant.bits_of(t.tensor_type), supers)
            # K-quants keep the file's two-level scales
            assert (supers is not None) == (t.tensor_type in K_QUANTS)
            assert (weight.bits == 6) == (t.tensor_type == GGMLQuantizationType.Q6_K)
            expected = torch.from_numpy(np.require(quants.dequantize(data, t.tensor_type), np.float32))
            assert torch.equal(weight.dequantize(), expected), (path.name, t.name, t.tensor_type.name)
            seen.add(t.tensor_type.name)
    assert seen == {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q5_K", "Q4_K", "Q6_K"}


@pytest.mark.parametrize("path", [p for p in SHARED_FILES if "F32" not in p.name], ids=lambda p: p.name)
def test_kept_checkpoint_holds_the_widened_weights(path, tmp_path):
    """The quantized cache entry's names, shapes and row order (llama's Q/K permutation undone) agree
    with the widened entry of the same file, weight by weight. The embedding table is written dense (for
    `none`, `int8`, `int4`) and, stored quantized, in group form as well (for `auto`'s lookups and a tied head)."""
    cache = tmp_path / "cache"
    kept = open_checkpoint(gguf_to_hf_dir(path, "float32", cache_root=cache, keep_quantized=True))
    widened = load_file(str(gguf_to_hf_dir(path, "float32", cache_root=cache) / "model.safetensors"))
    reader = GGUFReader(path)
    arch = reader.fields["general.architecture"].contents()
    types = {p.name: p.sources[0].tensor_type for p in tensor_plan(reader, arch, kept.config)}
    quantized = [name for name in widened if kept.is_quantized(name)]
    embed = "model.embed_tokens.weight"
    assert quantized and kept.is_quantized(embed) == (types[embed] in gguf_quant.KEPT_TYPES)
    assert torch.equal(kept.get(embed, tuple(widened[embed].shape), torch.float32), widened[embed])
    for name in quantized:
        weight = kept.get_linear(name, tuple(widened[name].shape), torch.float32)
        assert isinstance(weight, QuantizedWeight)
        assert (weight.supers is not None) == (types[name] in K_QUANTS)
        assert (weight.bits == 6) == (types[name] == GGMLQuantizationType.Q6_K)
        assert torch.equal(weight.dequantize(), widened[name]), name


@pytest.mark.parametrize("older", ("absent", 2))
def test_quantized_entry_in_an_older_group_form_is_converted_again(tmp_path, older):
    """A `-quantized` cache entry written in an older group form loads in that form (no group_format:
    fp32 scales per group; format 2: Q6_K requantized to int8); it is converted again instead."""
    path, cache = SHARED / "llama-Q6_K.gguf", tmp_path / "cache"
    entry = gguf_to_hf_dir(path, "float32", cache_root=cache, keep_quantized=True)
    marker = entry / gguf_module.MARKER
    current = f'"group_format": {gguf_module.GROUP_FORMAT}'
    marker.write_text(marker.read_text().replace(current, '"old_group_format": 1' if older == "absent"
                                                 else f'"group_format": {older}'))
    assert gguf_to_hf_dir(path, "float32", cache_root=cache, keep_quantized=True) == entry
    assert current in marker.read_text()
    stored = load_file(str(entry / "model.safetensors"))
    assert any(name.endswith(".qscales") and t.dtype == torch.int8 for name, t in stored.items())  # Q6_K as int6


def _greedy_agreement(model: str, **quantized) -> tuple[float, float]:
    """Greedy continuations quantized vs dense on the same weights: (share of prompts identical, mean
    share of the common prefix). Reported, not asserted: tiny random models sit near ties."""
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    common = dict(model=model, dtype="float32", max_model_len=128, kv_pool_tokens=1024)
    outs = [LLM(**common, **mode).generate(PROMPTS, params) for mode in ({"quantization": "none"}, quantized)]
    same, prefix = 0, 0.0
    for x, y in zip(*outs):
        first = next((i for i, (s, t) in enumerate(zip(x.token_ids, y.token_ids)) if s != t), NEW_TOKENS)
        same += first == NEW_TOKENS
        prefix += first / NEW_TOKENS
    return same / len(PROMPTS), prefix / len(PROMPTS)


def _teacher_forced_logits(model: str, mode: str, group: int = 32) -> torch.Tensor:
    """Logits at every position of one fixed 48-token sequence."""
    ckpt = open_checkpoint(model)
    cfg = parse_model_config(ckpt.config)
    cpu = torch.device("cpu")
    decoder = DenseDecoder(cfg, ckpt, torch.float32, cpu, LinearLoader(ckpt, torch.float32, cpu, mode, group))
    pool = KVPool(KVShape(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 16, torch.float32), 4, cpu)
    ids = torch.randint(0, min(400, cfg.vocab_size), (48,), generator=torch.Generator().manual_seed(3))
    batch = whole_prompt_batch(ids, first_block=0)
    with torch.inference_mode():
        return decoder.logits(decoder.forward(batch, pool.layers))


def _check_close_to_dense(model: str, record_property, label: str, mode: str = "auto") -> None:
    """The model quantized against the same model on its dequantized weights: per-position logits
    close, the same argmax almost everywhere (teacher forced), greedy agreement reported."""
    dense, quant = _teacher_forced_logits(model, "none"), _teacher_forced_logits(model, mode)
    error = float((quant - dense).abs().max() / dense.abs().max())
    top1 = float((quant.argmax(-1) == dense.argmax(-1)).float().mean())
    identical, prefix = _greedy_agreement(model, quantization=mode)
    for name, value in (("logit_error", error), ("top1", top1), ("greedy_identical", identical),
                        ("greedy_prefix", prefix)):
        record_property(f"{label}_{name}", value)
    print(f"{label}: logits max error {error:.4f} of max |logit|, teacher-forced top-1 agreement {top1:.3f}, "
          f"greedy: {identical:.2f} of prompts identical, mean common prefix {prefix:.2f}")
    assert error < 0.05 and top1 >= 0.9, f"{label}: logit error {error:.4f}, top-1 agreement {top1:.3f}"


def test_auto_keeps_each_stored_format_in_fused_layers():
    """Q4_K_M's pattern: attn_q/attn_k Q4_K fused with a Q6_K attn_v, ffn_down Q6_K alone. Each run of
    parts in one format is one weight, every weight exactly as stored; a dense part next to quantized
    ones meets them in int8."""
    g = torch.Generator().manual_seed(0)
    int4 = [quantize_int4(torch.randn(16, 256, generator=g)) for _ in range(2)]
    q6 = torch.randint(0, 64, (16, 256), generator=g, dtype=torch.uint8)
    scales6 = torch.randint(-128, 128, (16, 16), generator=g, dtype=torch.int8)
    int6 = QuantizedWeight.from_groups(q6, scales6, None, 6, torch.full((16, 1, 1), 1e-3))
    dense = torch.randn(16, 256, generator=g)
    loader = LinearLoader(StoredWeights({"q": int4[0], "k": int4[1], "v": int6, "down": int6, "dense": dense}),
                          torch.float32, torch.device("cpu"), "auto")
    qkv = loader.load([("q", 16, 256), ("k", 16, 256), ("v", 16, 256)])
    assert isinstance(qkv, LinearParts) and [p.bits for p in qkv.parts] == [4, 6]
    assert torch.equal(qkv.parts[0].dequantize(), torch.cat([w.dequantize() for w in int4]))
    assert torch.equal(qkv.parts[1].dequantize(), int6.dequantize())
    x, bias = torch.randn(3, 256, generator=g), torch.randn(48, generator=g)
    expected = torch.cat([quant_linear(x, w) for w in (*int4, int6)], dim=-1) + bias
    torch.testing.assert_close(linear(x, qkv, bias), expected, rtol=1e-5, atol=1e-5)
    assert weight_nbytes(qkv) == sum(w.nbytes for w in int4) + int6.nbytes
    down = loader.load([("down", 16, 256)])
    assert down.bits == 6 and torch.equal(down.dequantize(), int6.dequantize())
    mixed = loader.load([("q", 16, 256), ("dense", 16, 256)])
    assert isinstance(mixed, QuantizedWeight) and mixed.bits == 8
    assert torch.equal(mixed.dequantize()[:16], int4[0].dequantize())       # int4 widens exactly
    assert loader.describe() == "int6 g16x16 sym x2, int4 g32x8 asym x1, int8 g32x8 asym x1"


@pytest.mark.parametrize("path", [p for p in SHARED_FILES if "F32" not in p.name], ids=lambda p: p.name)
def test_gguf_model_runs_quantized(path, tmp_path, record_property):
    kept = str(gguf_to_hf_dir(path, "float32", cache_root=tmp_path / "cache", keep_quantized=True))
    _check_close_to_dense(kept, record_property, path.stem)


@pytest.mark.parametrize("file", ("qwen2-Q4_K-tied.gguf", "qwen3-hd128-Q4_K.gguf"))
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_gguf_keeps_its_embedding_table_quantized(tmp_path, file, dtype):
    """Under `auto` lookups dequantize just their rows of the file's quantized table, to what the dense
    table holds, so the dense table is not loaded. Tied, the same table is the output head and multiplies
    the file's blocks (Q6_K as int6)."""
    kept = gguf_to_hf_dir(SHARED / file, "float32", cache_root=tmp_path / "cache", keep_quantized=True)
    llm = LLM(model=str(kept), dtype=str(dtype).removeprefix("torch."), max_model_len=64, kv_pool_tokens=256)
    model = llm.engine.model
    tied = model.cfg.tie_word_embeddings
    assert tied == ("tied" in file)
    assert isinstance(model.embed, QuantizedWeight) and (model.embed is model.lm_head) == tied
    if tied:
        assert model.lm_head.bits == 6 and "int6 g16x16 sym x1" in llm.engine.weights
    llm.close()
    ckpt = open_checkpoint(kept)
    dense = ckpt.get("model.embed_tokens.weight", (model.cfg.vocab_size, model.cfg.hidden_size), dtype)
    ckpt.close()
    ids = torch.tensor([[0, 7, 8, model.cfg.vocab_size - 1], [5, 5, 13, 1]])    # tile edges, repeats
    assert torch.equal(embedding(ids, model.embed, dtype), dense[ids])


def _write_prequantized(source: Path, out: Path, mode: str, group: int) -> Path:
    """`source` with every linear weight stored in group form, quantized by ops.quant_weight."""
    shutil.copytree(source, out)
    tensors = load_file(str(out / "model.safetensors"))
    quantize = quantize_int8 if mode == "int8" else quantize_int4
    linear = [n for n in tensors if n.endswith("_proj.weight")] + (["lm_head.weight"] if "lm_head.weight" in tensors else [])
    for name in linear:
        groups = quantize(tensors.pop(name), group).to_groups()
        tensors.update({k: v for k, v in zip(group_tensor_names(name), groups) if v is not None})
    save_file(tensors, str(out / "model.safetensors"))
    return out


@pytest.mark.parametrize("mode, group", [("int8", 32), ("int4", 32), ("int4", 64)])
def test_checkpoint_quantized_at_load(tiny_checkpoint, tmp_path, record_property, mode, group):
    """Quantizing at load makes exactly the weights a checkpoint stored in that form holds (same tokens),
    and those run close to their dequantized selves."""
    path = tiny_checkpoint("qwen3", tied=False, heads=4, kv_heads=2, head_dim=32)
    stored = _write_prequantized(path, tmp_path / "stored", mode, group)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    common = dict(dtype="float32", max_model_len=128, kv_pool_tokens=1024)
    at_load = LLM(model=str(path), quantization=mode, quant_group_size=group, **common)
    assert at_load.engine.weights == f"{'int8 g32x8 sym' if mode == 'int8' else 'int4 g32x8 asym'} x9"
    from_disk = LLM(model=str(stored), **common)
    assert ([o.token_ids for o in at_load.generate(PROMPTS, params)]
            == [o.token_ids for o in from_disk.generate(PROMPTS, params)])
    _check_close_to_dense(str(stored), record_property, f"{mode}-g{group}")
def test_quantization_is_refused_where_it_cannot_run(tmp_path):
    cfg = make_engine_config(quantization="int4")
    with pytest.raises(ConfigError, match="runs on CPUs only"):
        resolve_quantization(cfg, torch.device("cuda"))
    assert resolve_quantization(make_engine_config(quantization="auto"), torch.device("cuda")) == "none"
    with pytest.raises(ConfigError, match="quant_group_size"):
        make_engine_config(quant_group_size=48)
