"""Checkpoint directories: every tiny variant loads as transformers loads it; bad inputs fail clearly."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.loading.checkpoint import CheckpointError, open_checkpoint
from engine.loading.model_config import ModelConfigError, parse_model_config
from tiny_models import hf_model, special_token_id

VARIANTS = {
    "qwen3-tied": ("qwen3", dict(tied=True)),
    "qwen2-untied": ("qwen2", dict(tied=False)),
    "llama-gqa4-dim64": ("llama", dict(heads=8, kv_heads=2, head_dim=64)),
}

EMBED = "model.embed_tokens.weight"
Q_PROJ = "model.layers.1.self_attn.q_proj.weight"


@pytest.fixture
def qwen3_copy(tiny_checkpoint, tmp_path):
    """A private copy of the default checkpoint that a test may damage."""
    return shutil.copytree(tiny_checkpoint("qwen3"), tmp_path / "ckpt")


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_tensor_matches_transformers(tiny_checkpoint, variant):
    arch, kwargs = VARIANTS[variant]
    path = tiny_checkpoint(arch, **kwargs)
    ckpt = open_checkpoint(path)
    reference = hf_model(path).state_dict()
    tied = kwargs.get("tied", True)

    assert ckpt.has("lm_head.weight") is not tied
    assert ckpt.names() == {n for n in reference if not (tied and n == "lm_head.weight")}
    for name in ckpt.names():
        tensor = ckpt.get(name, tuple(reference[name].shape), torch.float32)
        assert torch.equal(tensor, reference[name]), name


@pytest.mark.parametrize("variant", VARIANTS)
def test_model_config_describes_the_variant(tiny_checkpoint, variant):
    arch, kwargs = VARIANTS[variant]
    cfg = parse_model_config(open_checkpoint(tiny_checkpoint(arch, **kwargs)).config)
    assert cfg.architecture == {"qwen3": "Qwen3ForCausalLM", "qwen2": "Qwen2ForCausalLM",
                                "llama": "LlamaForCausalLM"}[arch]
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (
        kwargs.get("heads", 4), kwargs.get("kv_heads", 2), kwargs.get("head_dim", 32))
    assert cfg.tie_word_embeddings is kwargs.get("tied", True)
    assert (cfg.qkv_bias, cfg.qk_norm) == {"qwen3": (False, True), "qwen2": (True, False),
                                           "llama": (False, False)}[arch]
    assert cfg.rope_theta == 10000.0 and cfg.rms_norm_eps == 1e-6


def test_generation_eos_ids_come_from_generation_config(tiny_checkpoint):
    ckpt = open_checkpoint(tiny_checkpoint("qwen3"))
    assert ckpt.generation_eos_ids() == (special_token_id("<|im_end|>"), special_token_id("<|endoftext|>"))


def test_get_casts_once_and_is_contiguous(tiny_checkpoint):
    path = tiny_checkpoint("qwen3")
    raw = load_file(str(path / "model.safetensors"))[Q_PROJ]
    tensor = open_checkpoint(path).get(Q_PROJ, tuple(raw.shape), torch.bfloat16)
    assert tensor.dtype == torch.bfloat16 and tensor.is_contiguous()
    assert torch.equal(tensor, raw.to(torch.bfloat16))


def _mapped_file(tensor: torch.Tensor) -> str | None:
    """The file whose mapping holds the tensor's data, from /proc/self/maps (None: anonymous memory)."""
    address = tensor.data_ptr()
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        low, high = (int(a, 16) for a in fields[0].split("-"))
        if low <= address < high:
            return fields[5] if len(fields) == 6 and fields[5].startswith("/") else None
    return None


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads the process's mappings from /proc")
def test_weights_live_in_process_memory_not_in_the_file_mapping(tiny_checkpoint):
    """A tensor read in the stored dtype is copied out of safetensors' file mapping: a view of it faults
    its pages in from disk mid-step (the default model's embedding rows for 8 new token ids took 8 ms
    in a decode step)."""
    path = tiny_checkpoint("qwen3")
    raw = load_file(str(path / "model.safetensors"))[EMBED]
    tensor = open_checkpoint(path).get(EMBED, tuple(raw.shape), raw.dtype)
    assert torch.equal(tensor, raw)
    assert _mapped_file(tensor) is None


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads the process's mappings from /proc")
def test_a_built_engine_keeps_no_checkpoint_file_mapped(qwen3_copy):
    """The builder closes the checkpoint: its mapped pages were memory held for nothing (2.6 GB for the
    default model), and a closed checkpoint says so when read."""
    from engine import LLM, SamplingParams
    llm = LLM(model=str(qwen3_copy), dtype="float32", max_model_len=64, kv_pool_tokens=256)
    assert str(qwen3_copy) not in Path("/proc/self/maps").read_text()
    assert llm.generate(["hello"], SamplingParams(max_tokens=4, ignore_eos=True))[0].token_ids
    llm.close()
    ckpt = open_checkpoint(qwen3_copy)
    ckpt.close()
    with pytest.raises(CheckpointError, match="closed after loading"):
        ckpt.get(EMBED, (512, 64), torch.float32)


def test_sharded_checkpoint_gives_identical_tensors(qwen3_copy):
    single = load_file(str(qwen3_copy / "model.safetensors"))
    names = sorted(single)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for shard, shard_names in halves.items():
        save_file({n: single[n] for n in shard_names}, str(qwen3_copy / shard))
    weight_map = {n: shard for shard, shard_names in halves.items() for n in shard_names}
    (qwen3_copy / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (qwen3_copy / "model.safetensors").unlink()

    ckpt = open_checkpoint(qwen3_copy)
    assert ckpt.names() == set(single)
    for name, tensor in single.items():
        assert torch.equal(ckpt.get(name, tuple(tensor.shape), torch.float32), tensor), name


# ---- bad inputs: one clear error naming the file (and tensor) ----

def test_path_missing(tmp_path):
    with pytest.raises(CheckpointError, match=r"nowhere: no such directory"):
        open_checkpoint(tmp_path / "nowhere")


def test_path_is_a_file(qwen3_copy):
    with pytest.raises(CheckpointError, match=r"config\.json: is a file"):
        open_checkpoint(qwen3_copy / "config.json")


def test_config_json_missing(qwen3_copy):
    (qwen3_copy / "config.json").unlink()
    with pytest.raises(CheckpointError, match=r"config\.json: missing"):
        open_checkpoint(qwen3_copy)


def test_config_json_not_json(qwen3_copy):
    (qwen3_copy / "config.json").write_text('{"architectures": ["Qwen3ForCausalLM"],')
    with pytest.raises(CheckpointError, match=r"config\.json: not valid JSON .*line 1"):
        open_checkpoint(qwen3_copy)


def test_unknown_architecture_names_it_and_the_supported_ones(qwen3_copy):
    config = open_checkpoint(qwen3_copy).config
    config["architectures"] = ["MambaForCausalLM"]
    with pytest.raises(ModelConfigError, match=r"config\.json: .*MambaForCausalLM.*supported: .*Qwen3ForCausalLM"):
        parse_model_config(config)


def test_tensor_missing(tiny_checkpoint):
    ckpt = open_checkpoint(tiny_checkpoint("qwen3"))
    name = "model.layers.3.self_attn.q_proj.weight"
    with pytest.raises(CheckpointError) as err:
        ckpt.get(name, (128, 64), torch.float32)
    assert str(err.value) == f"model.safetensors: tensor '{name}' is missing"


def test_wrong_shape_names_file_tensor_and_both_shapes(tiny_checkpoint):
    ckpt = open_checkpoint(tiny_checkpoint("qwen3"))
    # qwen3 default: 4 heads x head_dim 32 = 128 rows, hidden 64 columns
    with pytest.raises(CheckpointError) as err:
        ckpt.get(Q_PROJ, (256, 64), torch.float32)
    message = str(err.value)
    assert message.startswith(f"model.safetensors: tensor '{Q_PROJ}'")
    assert "[128, 64]" in message and "[256, 64]" in message


@pytest.mark.parametrize("keep", [50, -1000], ids=["header-cut", "data-cut"])
def test_truncated_safetensors(qwen3_copy, keep):
    weights = qwen3_copy / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[:keep])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: .*truncated"):
        open_checkpoint(qwen3_copy)


def test_missing_shard(qwen3_copy):
    weight_map = {EMBED: "model-00001-of-00002.safetensors", Q_PROJ: "model-00002-of-00002.safetensors"}
    (qwen3_copy / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    shutil.move(qwen3_copy / "model.safetensors", qwen3_copy / "model-00001-of-00002.safetensors")
    with pytest.raises(CheckpointError, match=r"index\.json: lists shard 'model-00002-of-00002\.safetensors'"):
        open_checkpoint(qwen3_copy)


def test_no_weights_at_all(qwen3_copy):
    (qwen3_copy / "model.safetensors").rename(qwen3_copy / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match=r"no model\.safetensors .*pytorch_model\.bin: convert"):
        open_checkpoint(qwen3_copy)


def test_legacy_rope_theta_parses_like_rope_parameters(tiny_checkpoint):
    modern = dict(open_checkpoint(tiny_checkpoint("qwen3")).config)
    modern["rope_parameters"] = {"rope_type": "default", "rope_theta": 1_000_000.0}
    legacy = {k: v for k, v in modern.items() if k != "rope_parameters"}
    legacy["rope_theta"] = 1_000_000.0
    assert parse_model_config(legacy) == parse_model_config(modern)
    assert parse_model_config(legacy).rope_theta == 1_000_000.0


@pytest.mark.parametrize("variant", VARIANTS)
def test_tiny_models_give_varied_greedy_output(tiny_checkpoint, variant):
    # the fixtures' promise to every oracle test: std-0.15 weights do not collapse into one token
    arch, kwargs = VARIANTS[variant]
    model = hf_model(tiny_checkpoint(arch, **kwargs))
    prompt = torch.tensor([[11, 42, 99, 250, 7]])
    out = model.generate(prompt, max_new_tokens=16, min_new_tokens=16, do_sample=False)[0, 5:]
    assert len(set(out.tolist())) >= 6
