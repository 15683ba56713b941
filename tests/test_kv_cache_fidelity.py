"""Fidelity of a 16-bit or block-quantized K/V cache under fp32 activations, on tiny random models: greedy
tokens with bf16 and fp16 K/V against fp32 K/V (which equals transformers), and the logits with q8_0 and
q4_0 K/V fed the fp32 run's tokens, also for a Qwen2 model with a large k_proj bias (its keys are stored less
the bias's mean rotation); prompts prefilled in chunks (later chunks read the narrower cached prefix) and then
decoded a token a step (the C++ decode kernel)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.kv.pool import KVPool, KVShape
from engine.loading.checkpoint import open_checkpoint
from engine.loading.model_config import parse_model_config
from engine.models.batch import ForwardBatch
from engine.models.qwen3 import DenseDecoder
from tiny_models import hf_model

PROMPTS, NEW, CHUNK, BLOCK = 16, 24, 24, 16
CPU = torch.device("cpu")


def _greedy(model, kv_dtype: torch.dtype | str, ids: list[int], feed: list[int] | None = None):
    """The NEW greedy tokens after `ids`, or with `feed` the logits [NEW, vocab] of feeding those tokens."""
    cfg = model.cfg
    blocks = -(-(len(ids) + NEW) // BLOCK)
    pool = KVPool(KVShape(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, BLOCK, kv_dtype), blocks + 1, CPU)
    table = torch.arange(1, blocks + 1, dtype=torch.int32)[None]

    def step(tokens: list[int], start: int) -> torch.Tensor:
        n = len(tokens)
        positions = torch.arange(start, start + n)
        batch = ForwardBatch(input_ids=torch.tensor(tokens), positions=positions, slot_mapping=positions + BLOCK,
                             block_tables=table, query_start_loc=torch.tensor([0, n], dtype=torch.int32),
                             context_lens=torch.tensor([start + n], dtype=torch.int32),
                             logits_indices=torch.tensor([n - 1]))
        return model.logits(model.forward(batch, pool.layers))[0]

    with torch.inference_mode():
        for start in range(0, len(ids), CHUNK):
            logits = [step(ids[start:start + CHUNK], start)]
        out = [int(logits[0].argmax())] if feed is None else feed[:1]
        for _ in range(NEW - 1):
            logits.append(step([out[-1]], len(ids) + len(out) - 1))
            out.append(int(logits[-1].argmax()) if feed is None else feed[len(out)])
    return out if feed is None else torch.stack(logits)


def _hf_greedy(hf, ids: list[int]) -> list[int]:
    ids, out = list(ids), []
    with torch.no_grad():
        for _ in range(NEW):
            out.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
            ids.append(out[-1])
    return out


def _model_and_prompts(tiny_checkpoint):
    """A tiny fp32 model and PROMPTS random prompts of 20 to 90 tokens, the same every time."""
    path = tiny_checkpoint("qwen3", tied=False, heads=8, kv_heads=2, head_dim=64, layers=3)
    ckpt = open_checkpoint(path)
    model = DenseDecoder(parse_model_config(ckpt.config), ckpt, torch.float32, CPU)
    g = torch.Generator().manual_seed(3)
    return path, model, [torch.randint(0, 400, (int(n),), generator=g).tolist()
                         for n in torch.randint(20, 90, (PROMPTS,), generator=g)]


@pytest.mark.usefixtures("cpp_kernels")
def test_16_bit_kv_greedy_tokens_mostly_equal_fp32_kv(tiny_checkpoint, record_property):
    path, model, prompts = _model_and_prompts(tiny_checkpoint)
    reference = [_greedy(model, torch.float32, p) for p in prompts]
    assert reference[0] == _hf_greedy(hf_model(path), prompts[0])      # the loop itself is exact
    for name, kv_dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        runs = [_greedy(model, kv_dtype, p) for p in prompts]
        same = sum(a == b for a, b in zip(runs, reference)) / PROMPTS
        prefix = sum(next((i for i, (s, t) in enumerate(zip(a, b)) if s != t), NEW)
                     for a, b in zip(runs, reference)) / (PROMPTS * NEW)
        record_property(f"{name}_kv_identical_prompts", same)
        record_property(f"{name}_kv_prefix_agreement", prefix)
        print(f"{name} K/V vs fp32 K/V: {same:.0%} of {PROMPTS} prompts identical over {NEW} tokens, "
              f"greedy prefix agreement {prefix:.0%}")
        assert same >= 0.75 and prefix >= 0.85, name


# Bounds a little above the max abs logit error measured over the 16 prompts' steps (q8_0: 0.113 where the
# integer kernel rounds queries to int8 as it does on AVX-512 VNNI CPUs, 0.077 with 16-bit queries); q4_0's
# rounding step is about 16x q8_0's (amax / 8 against amax / 127), and so is its bound.
QUANT_LOGIT_BOUND = {"q8_0": 0.13, "q4_0": 1.5}


@pytest.mark.usefixtures("cpp_kernels")
def test_quantized_kv_logits_stay_close_to_fp32_kv(tiny_checkpoint, record_property):
    path, model, prompts = _model_and_prompts(tiny_checkpoint)
    tokens = [_greedy(model, torch.float32, p) for p in prompts]
    reference = [_greedy(model, torch.float32, p, feed=t) for p, t in zip(prompts, tokens)]
    for fmt, bound in QUANT_LOGIT_BOUND.items():
        err = max(float((_greedy(model, fmt, p, feed=t) - r).abs().max())
                  for p, t, r in zip(prompts, tokens, reference))
        record_property(f"{fmt}_kv_max_abs_logit_error", err)
        print(f"{fmt} K/V vs fp32 K/V: max abs logit error {err:.4f} (logits std "
              f"{float(torch.cat(reference).std()):.2f})")
        assert err < bound, fmt


class _LargeKeyBias:
    """A checkpoint whose k_proj biases get +-(100..200) in the four lowest-frequency rotary pairs of each
    kv head (head_dim 64), like Qwen2.5's: with its rope_theta (1e6) a few key channels far larger than the
    rest and nearly constant."""

    def __init__(self, ckpt):
        self.ckpt = ckpt

    def __getattr__(self, name):
        return getattr(self.ckpt, name)

    def get(self, name, shape, dtype):
        t = self.ckpt.get(name, shape, dtype)
        if name.endswith("k_proj.bias"):
            g = torch.Generator().manual_seed(len(name))
            big = torch.randn(2, 2, 4, generator=g).sign() * (100 + 100 * torch.rand(2, 2, 4, generator=g))
            t = t.clone().view(2, 64)
            t[:, 28:32] += big[:, 0].to(dtype)
            t[:, 60:64] += big[:, 1].to(dtype)
            t = t.view(shape)
        return t


def _q4_0_logit_error(model, prompts: list[list[int]]) -> float:
    """RMS logit error of q4_0 K/V against fp32 K/V, fed the fp32 run's greedy tokens, over the logits' RMS
    spread."""
    tokens = [_greedy(model, torch.float32, p) for p in prompts]
    want = torch.stack([_greedy(model, torch.float32, p, feed=t) for p, t in zip(prompts, tokens)])
    got = torch.stack([_greedy(model, "q4_0", p, feed=t) for p, t in zip(prompts, tokens)])
    return float((got - want).pow(2).mean().sqrt() / want.std())


@pytest.mark.usefixtures("cpp_kernels")
def test_keys_with_a_large_bias_quantize_like_keys_without(tiny_checkpoint):
    """The q4_0 logit error of the biased Qwen2 model is about the unbiased one's; stored as they are, the
    biased keys lose most of their content."""
    path = tiny_checkpoint("qwen2", tied=False, heads=8, kv_heads=2, head_dim=64, layers=3)
    ckpt = open_checkpoint(path)
    cfg = dataclasses.replace(parse_model_config(ckpt.config), rope_theta=1e6)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 400, (int(n),), generator=g).tolist() for n in (30, 55, 80, 90)]
    unbiased = _q4_0_logit_error(DenseDecoder(cfg, ckpt, torch.float32, CPU), prompts)
    model = DenseDecoder(cfg, _LargeKeyBias(ckpt), torch.float32, CPU)
    assert all(layer.k_offset is not None for layer in model.layers)
    less_offset = _q4_0_logit_error(model, prompts)
    for layer in model.layers:
        layer.k_offset = None
    as_they_are = _q4_0_logit_error(model, prompts)
    print(f"q4_0 K/V, relative RMS logit error: {unbiased:.4f} without the large k_proj bias; with it "
          f"{less_offset:.4f} less the offset, {as_they_are:.4f} as they are")
    assert less_offset < 1.5 * unbiased
    assert as_they_are > 4 * less_offset


def test_only_keys_that_are_a_projection_plus_bias_get_an_offset(tiny_checkpoint):
    """Qwen3's k norm comes after the bias; models without a k bias have nothing to subtract."""
    for arch in ("qwen3", "llama"):
        ckpt = open_checkpoint(tiny_checkpoint(arch))
        model = DenseDecoder(parse_model_config(ckpt.config), ckpt, torch.float32, CPU)
        assert all(layer.k_offset is None for layer in model.layers), arch
