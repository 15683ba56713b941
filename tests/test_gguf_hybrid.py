"""Hybrid and MoE GGUF files made by llama.cpp's own converter (tests/data, README there) against
transformers on the HF checkpoints they were converted from: f32 files to the checkpoint itself, Q8_0 files
to the checkpoint with each weight the converter quantized round-tripped through gguf's Q8_0."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from gguf import GGMLQuantizationType, quants
from safetensors.torch import load_file
from transformers.utils import logging as hf_logging

import engine.models.linear as linear_module
from engine.kv.pool import KVPool, KVShape, StatePool
from engine.loading.checkpoint import open_checkpoint
from engine.loading.gguf import gguf_to_hf_dir
from engine.loading.gguf_tensors import Planned
from engine.loading.gguf_weights import kept_in_groups
from engine.loading.model_config import parse_model_config
from engine.models.linear import LinearLoader
from engine.models.qwen3_5 import HybridDecoder
from ops.quant_weight import QuantizedWeight
from tiny_models import hf_hybrid_model, whole_prompt_batch

DATA = Path(__file__).parent / "data"
MODELS = ("qwen3moe", "qwen3next", "qwen35", "qwen35moe")
Q8_0 = GGMLQuantizationType.Q8_0
IDS = torch.randint(0, 500, (40,), generator=torch.Generator().manual_seed(3))

hf_logging.set_verbosity_error()


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("gguf-hybrid-cache")


def _engine_logits(directory: Path, quantization: str = "none") -> tuple[HybridDecoder, torch.Tensor]:
    """Our model on a converted dir, fp32, and its logits at every position of IDS."""
    ckpt = open_checkpoint(directory)
    cfg = parse_model_config(ckpt.config)
    loader = LinearLoader(ckpt, torch.float32, torch.device("cpu"), quantization)
    model = HybridDecoder(cfg, ckpt, torch.float32, torch.device("cpu"), loader)
    pool = KVPool(KVShape(model.num_kv_layers, cfg.num_kv_heads, cfg.head_dim, 16, torch.float32), 4,
                  torch.device("cpu"))
    states = StatePool(model.state_shape, 1, torch.device("cpu")).layers if model.state_shape else ()
    with torch.inference_mode():
        return model, model.logits(model.forward(whole_prompt_batch(IDS), pool.layers, states,
                                                 torch.tensor([0], dtype=torch.int32)))


def _tiled(w: torch.Tensor, config: dict) -> torch.Tensor:
    """out_proj's inputs in the order llama.cpp's Qwen3.5 converter writes them (value heads tiled)."""
    hk, hv = config["linear_num_key_heads"], config["linear_num_value_heads"]
    return w.view(w.shape[0], hk, hv // hk, -1).transpose(1, 2).reshape(w.shape)


def _grouped(w: torch.Tensor, config: dict) -> torch.Tensor:
    hk, hv = config["linear_num_key_heads"], config["linear_num_value_heads"]
    return w.view(w.shape[0], hv // hk, hk, -1).transpose(1, 2).reshape(w.shape)


def _as_q8_0_file_holds(name: str, w: torch.Tensor, config: dict) -> torch.Tensor:
    """What the Q8_0 file holds for HF weight `name`: the converter quantizes every weight of two or more
    dims but the router, the shared-expert gate and conv1d, along the inputs, after its own reorders (only
    Qwen3.5's out_proj column order changes which values share a block)."""
    if w.dim() < 2 or name.endswith(("conv1d.weight", "mlp.gate.weight", "shared_expert_gate.weight")):
        return w
    tiled = name.endswith("linear_attn.out_proj.weight") and config["model_type"].startswith("qwen3_5")
    values = _tiled(w, config) if tiled else w
    rows = values.reshape(-1, values.shape[-1]).numpy()
    values = torch.from_numpy(quants.dequantize(quants.quantize(rows, Q8_0), Q8_0)).view(w.shape)
    return _grouped(values, config) if tiled else values


def _oracle_logits(name: str, qtype: str) -> torch.Tensor:
    hf = hf_hybrid_model(DATA / f"{name}-hf")
    if qtype == "q8_0":
        config = json.loads((DATA / f"{name}-hf" / "config.json").read_text())
        with torch.no_grad():
            for param_name, param in hf.named_parameters():
                param.copy_(_as_q8_0_file_holds(param_name, param, config))
    with torch.no_grad():
        return hf(IDS[None]).logits[0]


@pytest.mark.parametrize("qtype", ["f32", "q8_0"])
@pytest.mark.parametrize("name", MODELS)
def test_converter_made_file_matches_transformers(cache, name, qtype):
    converted = gguf_to_hf_dir(DATA / f"{name}-{qtype}.gguf", "float32", cache_root=cache)
    torch.testing.assert_close(_engine_logits(converted)[1], _oracle_logits(name, qtype), atol=2e-5, rtol=2e-5)


def test_rebuilt_config_skips_mtp_and_reads_recurrent_layers(cache):
    """qwen35-f32 has 3 blocks, the last an MTP block, and a full_attention_interval of 4 (the converter's
    default) that its recurrent-layer flags contradict."""
    config = json.loads((gguf_to_hf_dir(DATA / "qwen35-f32.gguf", "float32", cache_root=cache) / "config.json")
                        .read_text())
    original = json.loads((DATA / "qwen35-hf" / "config.json").read_text())
    assert config["num_hidden_layers"] == 2 and config["layer_types"] == original["layer_types"]
    for key in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
                "linear_conv_kernel_dim", "head_dim", "tie_word_embeddings"):
        assert config[key] == original[key], key
    assert config["rope_parameters"]["partial_rotary_factor"] == 0.25


def test_moe_config_matches_checkpoint(cache):
    config = json.loads((gguf_to_hf_dir(DATA / "qwen35moe-q8_0.gguf", "float32", cache_root=cache) /
                         "config.json").read_text())
    original = json.loads((DATA / "qwen35moe-hf" / "config.json").read_text())
    for key in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size"):
        assert config[key] == original[key], key


@pytest.mark.parametrize("name", MODELS)
def test_kept_groups_hold_the_widened_weights(cache, name):
    """Every weight kept in group form (rows reordered, out_proj's columns moved in whole blocks) dequantizes
    to exactly the widened conversion's tensor; 3-D experts, routers and conv1d are widened only."""
    path = DATA / f"{name}-q8_0.gguf"
    kept = open_checkpoint(gguf_to_hf_dir(path, "float32", cache_root=cache, keep_quantized=True))
    widened = load_file(gguf_to_hf_dir(path, "float32", cache_root=cache) / "model.safetensors")
    quantized = {n for n in widened if kept.is_quantized(n)}
    assert any(".linear_attn." in n or ".self_attn." in n for n in quantized)
    assert not any("experts" in n or n.endswith(("mlp.gate.weight", "conv1d.weight")) for n in quantized)
    for n in quantized:
        weight = kept.get_linear(n, tuple(widened[n].shape), torch.float32)
        assert torch.equal(weight.dequantize(), widened[n]), n


@pytest.mark.parametrize("name", MODELS)
def test_kept_quantized_hybrid_runs_quant_linear(cache, name, monkeypatch):
    """Kept in group form, the Q8_0 projections run through quant_linear as int8 with the file's scales,
    and the model stays close to the same file widened (quant_linear rounds activations to int8 too)."""
    calls = []
    real = linear_module.quant_linear
    monkeypatch.setattr(linear_module, "quant_linear", lambda *a: calls.append(1) or real(*a))
    path = DATA / f"{name}-q8_0.gguf"
    model, quantized = _engine_logits(gguf_to_hf_dir(path, "float32", cache_root=cache, keep_quantized=True),
                                      "auto")
    dense = _engine_logits(gguf_to_hf_dir(path, "float32", cache_root=cache))[1]
    assert calls and set(model.linears.formats) <= {"int8 g32 sym", "float32"}
    mixers = [layer.attention or layer.linear for layer in model.layers]
    projections = [getattr(m, attr) for m in mixers for attr in ("qkvg_w", "o_w", "in_w") if hasattr(m, attr)]
    for mlp in (layer.mlp for layer in model.layers):
        projections += [mlp.gate_up, mlp.down] if not mlp.sparse else list(mlp.shared[:2]) if mlp.shared else []
    assert projections and all(isinstance(w, QuantizedWeight) for w in projections)
    assert isinstance(model.lm_head, QuantizedWeight)
    # Qwen3.5's out_proj columns are reordered by value head: heads of 16 split Q8_0's 32-value blocks
    # (qwen35: widened), heads of 32 are whole blocks (qwen35moe: kept); qwen3next's are not reordered
    for mixer in mixers:
        if hasattr(mixer, "out_w"):
            assert isinstance(mixer.out_w, QuantizedWeight) == (name != "qwen35")
    # per position: rounded activations can flip a routing choice, which moves that position's logits a lot
    top1 = (quantized.argmax(-1) == dense.argmax(-1)).float().mean()
    error = (quantized - dense).abs().amax(-1).median() / dense.abs().max()
    assert top1 >= 0.9 and error < 0.05, (top1, error)


def test_value_head_columns_in_k_quant_blocks_widen():
    """Real Qwen3.5 out_proj: 128-value heads inside Q4_K's 256-value blocks cannot move in group form."""
    name = "model.layers.0.linear_attn.out_proj.weight"

    def kept(kind: GGMLQuantizationType, cols: torch.Tensor) -> bool:
        source = SimpleNamespace(tensor_type=kind, shape=(512, 64))
        return kept_in_groups([Planned(name, (source,), True, cols=cols)]) == {name}
    heads = torch.arange(512).view(2, 2, 128).transpose(0, 1).reshape(-1)     # 4 heads of 128, regrouped
    blocks = torch.arange(512).view(2, 256).flip(0).reshape(-1)                # the two 256-value blocks swapped
    assert kept(Q8_0, heads) and not kept(GGMLQuantizationType.Q4_K, heads)
    assert kept(GGMLQuantizationType.Q4_K, blocks)
