"""Rotary position scaling (engine/loading/rope_scaling.py, ops.rope_cos_sin): yarn, linear and llama3
tables bit for bit as transformers builds them, models past their trained context against transformers
(config.json, GGUF and the rope_scaling / rope_scale keys), and the errors that say what to set."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from transformers import LlamaConfig, Qwen2Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from engine import LLM, SamplingParams
from engine.config import ConfigError, EngineConfig
from engine.kv.pool import KVPool, KVShape, StatePool
from engine.loading.checkpoint import open_checkpoint
from engine.loading.gguf import gguf_to_hf_dir
from engine.loading.model_config import ModelConfigError, parse_model_config
from engine.models.qwen3 import DenseDecoder
from engine.models.qwen3_5 import HybridDecoder
from gguf_writer import write_gguf
from ops import rope_cos_sin
from tiny_models import hf_hybrid_model, hf_model, make_hybrid_checkpoint, whole_prompt_batch

TRAINED = 64        # the tiny checkpoints' max_position_embeddings: every test runs past it
# config.json's `rope_scaling` as the model cards say to add it (Qwen2.5: yarn, factor 4)
SCALINGS = {
    "yarn": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": TRAINED},
    "yarn-ramp": {"rope_type": "yarn", "factor": 3.0, "original_max_position_embeddings": TRAINED,
                  "beta_fast": 16, "beta_slow": 2, "truncate": False},
    "yarn-attention": {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": TRAINED,
                       "attention_factor": 1.3},
    "linear": {"type": "linear", "factor": 2.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16},
}


def _config(name: str) -> tuple[dict, object]:
    """config.json's dict for a one-layer model with SCALINGS[name], and transformers' config of it."""
    keys = dict(hidden_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=32, num_hidden_layers=1,
                intermediate_size=64, vocab_size=100, rope_theta=10000.0, max_position_embeddings=TRAINED,
                rope_scaling=dict(SCALINGS[name]))
    config_class = LlamaConfig if name == "llama3" else Qwen2Config
    raw = {"architectures": [config_class.__name__.replace("Config", "ForCausalLM")], **keys}
    return raw, config_class(**keys | {"rope_scaling": dict(SCALINGS[name])})


@pytest.mark.parametrize("name", list(SCALINGS))
def test_the_table_is_transformers_bit_for_bit(name):
    raw, hf = _config(name)
    cfg = parse_model_config(raw)
    inv_freq, attention = ROPE_INIT_FUNCTIONS[hf.rope_parameters["rope_type"]](hf, "cpu")
    positions = torch.arange(cfg.max_position_embeddings, dtype=torch.float32)
    freqs = (inv_freq[None, :, None].float() @ positions[None, None, :]).transpose(1, 2)[0]
    want = torch.cat((freqs.cos() * attention, freqs.sin() * attention), dim=-1)
    assert torch.equal(rope_cos_sin(cfg.max_position_embeddings, 32, 10000.0, cfg.rope_params), want)
    assert not torch.equal(want, rope_cos_sin(cfg.max_position_embeddings, 32, 10000.0))


@pytest.mark.parametrize("name, positions", [("yarn", 4 * TRAINED), ("yarn-ramp", 3 * TRAINED),
                                             ("linear", 2 * TRAINED), ("llama3", TRAINED)])
def test_positions_served(name, positions):
    """yarn and linear serve factor x the trained context (as vLLM derives it); llama3 configs state theirs."""
    assert parse_model_config(_config(name)[0]).max_position_embeddings == positions


@pytest.mark.parametrize("scaling, words", [({"type": "dynamic", "factor": 2.0}, "rope type 'dynamic'"),
                                            ({"type": "yarn", "factor": 0.5}, "'factor' >= 1"),
                                            ({"rope_type": "llama3", "factor": 8.0}, "'low_freq_factor'")])
def test_a_scaling_that_cannot_be_served_names_the_file_and_key(scaling, words):
    raw = _config("yarn")[0] | {"rope_scaling": scaling}
    with pytest.raises(ModelConfigError, match=f"^my/config.json: .*{words}"):
        parse_model_config(raw, source="my/config.json")


@pytest.fixture(scope="module")
def scaled(tiny_checkpoint, tmp_path_factory):
    """name -> a tiny checkpoint trained (max_position_embeddings) to TRAINED positions, with
    SCALINGS[name] in its config.json; "plain" has none."""
    def make(name: str):
        arch = "llama" if name.startswith("llama3") else "qwen2"
        source = tiny_checkpoint(arch, tied=False, heads=4, kv_heads=2, head_dim=32, max_pos=TRAINED)
        if name == "plain":
            return source
        path = tmp_path_factory.mktemp(f"rope-{name}")
        shutil.copytree(source, path, dirs_exist_ok=True)
        config = json.loads((path / "config.json").read_text())
        if name.endswith("-beside"):    # added to a file transformers 5 wrote: beside its rope_parameters
            config["rope_scaling"] = SCALINGS[name.removesuffix("-beside")]
        else:                           # the older layout: theta and rope_scaling at the top level
            config |= {"rope_theta": config.pop("rope_parameters")["rope_theta"], "rope_scaling": SCALINGS[name]}
        (path / "config.json").write_text(json.dumps(config))
        return path
    return make


@pytest.mark.parametrize("name", ["yarn", "yarn-beside", "linear", "llama3"])
def test_logits_past_the_trained_context_match_transformers(scaled, name):
    path = scaled(name)
    cfg = parse_model_config(open_checkpoint(path).config)
    model = DenseDecoder(cfg, open_checkpoint(path), torch.float32, torch.device("cpu"))
    length = min(cfg.max_position_embeddings, 3 * TRAINED)
    pool = KVPool(KVShape(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 16, torch.float32), length // 16 + 2,
                  torch.device("cpu"))
    ids = torch.randint(0, cfg.vocab_size, (length,), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        ours = model.logits(model.forward(whole_prompt_batch(ids), pool.layers))
        theirs = hf_model(path)(ids[None]).logits[0]
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)


def test_a_hybrid_model_s_attention_layers_scale_as_transformers_does(tmp_path):
    """Qwen3.5 (partial rotary, M-RoPE sections that text positions make plain) with yarn in its
    rope_parameters, past the trained context."""
    path = make_hybrid_checkpoint(tmp_path, arch="qwen3_5", max_pos=TRAINED)
    config = json.loads((path / "config.json").read_text())
    config["rope_parameters"] |= {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": TRAINED}
    (path / "config.json").write_text(json.dumps(config))
    cfg = parse_model_config(open_checkpoint(path).config)
    model = HybridDecoder(cfg, open_checkpoint(path), torch.float32, torch.device("cpu"))
    pool = KVPool(KVShape(model.num_kv_layers, cfg.num_kv_heads, cfg.head_dim, 16, torch.float32), 14,
                  torch.device("cpu"))
    states = StatePool(model.state_shape, 3, torch.device("cpu")).layers
    ids = torch.randint(0, cfg.vocab_size, (3 * TRAINED,), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        ours = model.logits(model.forward(whole_prompt_batch(ids), pool.layers, states,
                                          torch.tensor([2], dtype=torch.int32)))
        theirs = hf_hybrid_model(path)(ids[None]).logits[0]
    assert cfg.max_position_embeddings == 4 * TRAINED
    torch.testing.assert_close(ours, theirs, atol=2e-4, rtol=2e-4)


GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPT = torch.randint(3, 400, (3 * TRAINED,), generator=torch.Generator().manual_seed(5)).tolist()


def _greedy(path, prompt=PROMPT, **config) -> tuple[list[int], int]:
    llm = LLM(model=str(path), dtype="float32", max_concurrency=1, kv_pool_tokens=512, **config)
    try:
        return llm.generate([prompt], GREEDY)[0].token_ids, llm.engine.max_model_len
    finally:
        llm.close()


def test_the_keys_scale_a_plain_checkpoint_as_its_config_would(scaled):
    """--rope-scaling yarn --rope-scale 4 on a checkpoint without scaling: the positions and greedy tokens
    of the same checkpoint whose config.json asks for that scaling."""
    tokens, positions = _greedy(scaled("plain"), rope_scaling="yarn", rope_scale=4)
    assert positions == 4 * TRAINED
    assert (tokens, positions) == _greedy(scaled("yarn"))
    unscaled = _greedy(scaled("plain"), prompt=PROMPT[:TRAINED - 8])[0]
    assert unscaled != _greedy(scaled("plain"), prompt=PROMPT[:TRAINED - 8], rope_scaling="yarn", rope_scale=4)[0]


def test_the_engine_info_shows_the_scaling_served(scaled):
    """What /props and the front ends read: the model's own scaling under auto, the keys' in its place."""
    from engine.client import EngineClient

    def info(path, **config):
        client = EngineClient(LLM(model=str(path), dtype="float32", kv_pool_tokens=512, **config).engine)
        try:
            return client.info()
        finally:
            client.close()

    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": TRAINED}
    own = info(scaled("yarn"))
    assert (own.rope_scaling, own.max_model_len) == (yarn, 4 * TRAINED)
    assert info(scaled("plain"), rope_scaling="yarn", rope_scale=4).rope_scaling == yarn
    assert (info(scaled("yarn"), rope_scaling="none").rope_scaling, info(scaled("plain")).rope_scaling) == (None, None)
    linear = info(scaled("plain"), rope_scaling="linear", rope_scale=2)
    assert (linear.rope_scaling["rope_type"], linear.max_model_len) == ("linear", 2 * TRAINED)


def test_none_serves_the_trained_context_with_plain_rotary(scaled):
    short = PROMPT[:TRAINED - 8]
    assert _greedy(scaled("yarn"), prompt=short, rope_scaling="none") == _greedy(scaled("plain"), prompt=short)


def test_too_long_a_max_model_len_points_at_rope_scaling(scaled):
    with pytest.raises(ConfigError, match=r"max_position_embeddings \(64\); use at most 64, or serve more "
                                          r"positions with --rope-scaling yarn --rope-scale 3"):
        _greedy(scaled("plain"), max_model_len=3 * TRAINED)


@pytest.mark.parametrize("keys", [dict(rope_scaling="yarn"), dict(rope_scaling="linear"), dict(rope_scale=4),
                                  dict(rope_scaling="none", rope_scale=2)])
def test_the_kind_and_the_scale_come_together(keys):
    with pytest.raises(ConfigError, match="need rope_scale, how many times the trained context"):
        EngineConfig(**keys)


def test_a_gguf_file_s_yarn_keys_scale_as_the_config_json_does(tmp_path, scaled):
    """The converter's rope.scaling.* keys, F32 weights (lossless): the converted model computes what
    transformers computes for the original checkpoint with yarn in its config.json."""
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": TRAINED}
    path = write_gguf(tmp_path, "qwen2", "F32", head_dim=32, rope_scaling=yarn)
    converted = gguf_to_hf_dir(path, "float32", cache_root=tmp_path / "cache")
    cfg = parse_model_config(json.loads((converted / "config.json").read_text()))
    assert cfg.rope_params == yarn and cfg.max_position_embeddings == 4 * TRAINED
    original = tmp_path / "hf-qwen2-F32"
    config = json.loads((original / "config.json").read_text())
    theta = config.pop("rope_parameters")["rope_theta"]
    (original / "config.json").write_text(json.dumps(config | {"rope_theta": theta, "rope_scaling": yarn}))
    ids = torch.randint(0, cfg.vocab_size, (3 * TRAINED,), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(hf_model(converted)(ids[None]).logits, hf_model(original)(ids[None]).logits,
                                   atol=1e-5, rtol=0)


def test_a_saved_prefix_cache_is_not_read_under_another_scaling(scaled, tmp_path):
    """The K/V of a position differs with the rotary table: the snapshot's fingerprint holds the scaling."""
    def restored(**config) -> int:
        llm = LLM(model=str(scaled("plain")), dtype="float32", max_concurrency=1, kv_pool_tokens=512,
                  prefix_cache_dir=str(tmp_path), **config)
        try:
            llm.generate([PROMPT[:48]], GREEDY)
            return llm.engine.snapshot.restored
        finally:
            llm.close()

    assert restored() == 0
    assert restored(rope_scaling="yarn", rope_scale=4) == 0
    assert restored() > 0


def test_a_draft_model_is_scaled_with_the_target(scaled):
    """The keys stretch the draft too, so it serves the target's positions (check_draft refuses a shorter one)
    and its proposals change no greedy token."""
    plain = _greedy(scaled("plain"), rope_scaling="yarn", rope_scale=4)
    assert _greedy(scaled("plain"), rope_scaling="yarn", rope_scale=4, draft_model=str(scaled("plain")),
                   draft_quantization="none") == plain


def test_the_console_names_the_scaled_context(scaled):
    from console.client import InProcessClient

    client = InProcessClient(EngineConfig(model=str(scaled("plain")), dtype="float32", kv_pool_tokens=512,
                                          rope_scaling="yarn", rope_scale=4))
    try:
        assert " · 256-token context (yarn x4) · 512 K/V tokens " in client.connect(lambda d, t: None)
    finally:
        client.close()
