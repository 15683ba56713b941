"""Random Qwen3 checkpoints shaped like real ones, for speed runs; built once, cached on disk.

Weights are written straight from torch tensors with safetensors (instantiating the transformers
model first would take longer than the benchmark itself). The tokenizer is the tests' tiny BPE
(~500 tokens), so prompts must use ids below `PROMPT_ID_LIMIT`; the vocabulary of the weights is the
real model's, so the lm_head costs what it costs in the real model.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

CACHE_ROOT = Path(os.path.expanduser("~/.cache/pagedserve/bench"))
PROMPT_ID_LIMIT = 500      # the tiny tokenizer's vocabulary: prompt ids stay below this
WEIGHT_STD = 0.02          # speed runs only: the output text does not matter


@dataclass(frozen=True)
class BenchModelSpec:
    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    max_pos: int = 40960

    @property
    def dirname(self) -> str:
        return (f"qwen3-{self.name}-h{self.hidden}-l{self.layers}-a{self.heads}x{self.kv_heads}"
                f"x{self.head_dim}-i{self.intermediate}-v{self.vocab}")


SPECS = {
    "0.6b": BenchModelSpec("0.6b", hidden=1024, layers=28, heads=16, kv_heads=8, head_dim=128,
                           intermediate=3072, vocab=151936),
    # same layer shapes and vocabulary, 4 layers: a smoke run in seconds
    "mini": BenchModelSpec("mini", hidden=1024, layers=4, heads=16, kv_heads=8, head_dim=128,
                           intermediate=3072, vocab=151936),
}


class BenchModelError(ValueError):
    """Unknown bench model name; the message lists the allowed ones."""


def _tiny_models():
    """tests/tiny_models.py holds the one tokenizer builder; bench reuses it rather than copy it."""
    tests_dir = str(Path(__file__).resolve().parent.parent / "tests")
    if tests_dir not in sys.path:
        sys.path.insert(0, tests_dir)
    import tiny_models

    return tiny_models


def _config(spec: BenchModelSpec, eos_id: int, pad_id: int) -> dict:
    from transformers import Qwen3Config

    cfg = Qwen3Config(
        vocab_size=spec.vocab, hidden_size=spec.hidden, intermediate_size=spec.intermediate,
        num_hidden_layers=spec.layers, num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads, head_dim=spec.head_dim,
        max_position_embeddings=spec.max_pos, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
        tie_word_embeddings=True, bos_token_id=None, eos_token_id=eos_id, pad_token_id=pad_id,
        torch_dtype="bfloat16")
    data = cfg.to_dict()
    data["architectures"] = ["Qwen3ForCausalLM"]
    return data


def _weights(spec: BenchModelSpec, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return (torch.randn(shape, generator=gen, dtype=torch.float32) * WEIGHT_STD).to(torch.bfloat16)

    def ones(n):
        return torch.ones(n, dtype=torch.bfloat16)

    h, q, kv = spec.hidden, spec.heads * spec.head_dim, spec.kv_heads * spec.head_dim
    out = {"model.embed_tokens.weight": rand(spec.vocab, h), "model.norm.weight": ones(h)}
    for i in range(spec.layers):
        p = f"model.layers.{i}."
        out |= {
            p + "input_layernorm.weight": ones(h),
            p + "post_attention_layernorm.weight": ones(h),
            p + "self_attn.q_proj.weight": rand(q, h),
            p + "self_attn.k_proj.weight": rand(kv, h),
            p + "self_attn.v_proj.weight": rand(kv, h),
            p + "self_attn.o_proj.weight": rand(h, q),
            p + "self_attn.q_norm.weight": ones(spec.head_dim),
            p + "self_attn.k_norm.weight": ones(spec.head_dim),
            p + "mlp.gate_proj.weight": rand(spec.intermediate, h),
            p + "mlp.up_proj.weight": rand(spec.intermediate, h),
            p + "mlp.down_proj.weight": rand(h, spec.intermediate),
        }
    return out


def _write(spec: BenchModelSpec, directory: Path) -> None:
    from safetensors.torch import save_file

    tiny = _tiny_models()
    eos_id, pad_id = tiny.special_token_id("<|im_end|>"), tiny.special_token_id("<|endoftext|>")
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(_config(spec, eos_id, pad_id), indent=2))
    generation = {"eos_token_id": [eos_id, pad_id], "pad_token_id": pad_id, "bos_token_id": None}
    (directory / "generation_config.json").write_text(json.dumps(generation, indent=2))
    tiny.build_tokenizer(directory)
    save_file(_weights(spec), str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "bench_spec.json").write_text(json.dumps(asdict(spec), indent=2))


def bench_model_dir(name: str, cache_root: Path = CACHE_ROOT) -> Path:
    """The checkpoint directory for `name` ("0.6b" or "mini"), built on first use."""
    if name not in SPECS:
        raise BenchModelError(f"bench model {name!r} is unknown; use one of {sorted(SPECS)} "
                              f"(--bench-model)")
    spec = SPECS[name]
    final = cache_root / spec.dirname
    if (final / "bench_spec.json").is_file():
        return final
    # build beside the final place and rename: an interrupted build never looks finished
    partial = cache_root / f"{spec.dirname}.partial-{os.getpid()}"
    shutil.rmtree(partial, ignore_errors=True)
    _write(spec, partial)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(partial, final)
    return final

