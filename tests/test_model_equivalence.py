"""Our dense models against transformers (the oracle) in fp32: logits, greedy tokens, chunked and
batched runs, and bf16 agreement."""
from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.kv.pool import KVPool, KVShape
from engine.loading.checkpoint import open_checkpoint
from engine.loading.model_config import parse_model_config
from engine.models.qwen3 import DenseDecoder
from engine.runner import PrefillBudget
from tiny_models import hf_model, whole_prompt_batch

VARIANTS = {
    "qwen3-tied-gqa2-hd32": dict(arch="qwen3", tied=True, heads=4, kv_heads=2, head_dim=32),
    "qwen3-untied-gqa4-hd64": dict(arch="qwen3", tied=False, heads=8, kv_heads=2, head_dim=64),
    "qwen2-bias-untied-gqa2-hd32": dict(arch="qwen2", tied=False, heads=4, kv_heads=2, head_dim=32),
    "qwen2-bias-tied-gqa4-hd64": dict(arch="qwen2", tied=True, heads=8, kv_heads=2, head_dim=64,
                                      hidden=128),
    "llama-untied-gqa4-hd32": dict(arch="llama", tied=False, heads=8, kv_heads=2, head_dim=32,
                                   hidden=128),
    "llama-tied-gqa2-hd64": dict(arch="llama", tied=True, heads=4, kv_heads=2, head_dim=64),
}

PROMPTS = ["The quick brown fox", "def generate(prompt", "Der schnelle braune Fuchs springt über",
           "模型把每个请求的键和值"]


@pytest.fixture(params=list(VARIANTS), scope="module")
def variant(request, tiny_checkpoint):
    spec = dict(VARIANTS[request.param])
    return tiny_checkpoint(spec.pop("arch"), **spec)


def _hf_greedy(hf, ids: list[int], n: int) -> list[int]:
    """Greedy decoding by full re-forwarding: the plainest possible oracle."""
    ids = list(ids)
    out = []
    with torch.no_grad():
        for _ in range(n):
            tok = int(hf(torch.tensor([ids])).logits[0, -1].argmax())
            out.append(tok)
            ids.append(tok)
    return out


def test_prefill_logits_match_transformers(variant):
    ckpt = open_checkpoint(variant)
    cfg = parse_model_config(ckpt.config)
    model = DenseDecoder(cfg, ckpt, torch.float32, torch.device("cpu"))
    pool = KVPool(KVShape(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 16, torch.float32), 8,
                  torch.device("cpu"))
    ids = torch.randint(0, cfg.vocab_size, (37,), generator=torch.Generator().manual_seed(1))
    batch = whole_prompt_batch(ids)
    with torch.inference_mode():
        ours = model.logits(model.forward(batch, pool.layers))
        theirs = hf_model(variant)(ids[None]).logits[0]
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)


def test_greedy_tokens_match_transformers(variant):
    # exact against transformers: fp32 K/V too (the default, auto, stores bf16 on CPUs; its fidelity is
    # tests/test_kv_cache_fidelity.py's)
    llm = LLM(model=str(variant), dtype="float32", max_model_len=128, kv_pool_tokens=1024, kv_cache_dtype="fp32")
    hf = hf_model(variant)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    outs = llm.generate(PROMPTS, params)
    for prompt, out in zip(PROMPTS, outs):
        ids = llm.tokenizer.encode(prompt)
        assert out.token_ids == _hf_greedy(hf, ids, 32), prompt
        assert out.finish_reason.value == "length"
    assert llm.engine.scheduler.stats().blocks_used == 0


@pytest.mark.parametrize("block_size", [16, 8])
def test_chunked_batched_equals_alone(tiny_checkpoint, block_size):
    """Four prompts of lengths 15/16/17/33 in one flat batch, fed in chunks split at odd
    boundaries, give each sequence the tokens it gets alone (and what transformers gives)."""
    path = tiny_checkpoint("qwen3", tied=False, heads=8, kv_heads=2, head_dim=32)
    hf = hf_model(path)
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 400, (n,), generator=gen).tolist() for n in (15, 16, 17, 33)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    llm = LLM(model=str(path), dtype="float32", max_model_len=128, kv_pool_tokens=2048,
              block_size=block_size)
    llm.engine.runner.budget = PrefillBudget(idle_total=13, mixed_total=7, quantum=5)
    together = llm.generate(prompts, params)
    for p, out in zip(prompts, together):
        assert out.token_ids == _hf_greedy(hf, p, 12)
    alone = [llm.generate([p], params)[0] for p in prompts]
    assert [o.token_ids for o in together] == [o.token_ids for o in alone]


def test_bf16_mostly_agrees_with_fp32(tiny_checkpoint, record_property):
    path = tiny_checkpoint("qwen3", tied=True, heads=4, kv_heads=2, head_dim=32)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    fp32 = LLM(model=str(path), dtype="float32", max_model_len=128, kv_pool_tokens=1024)
    bf16 = LLM(model=str(path), dtype="bfloat16", max_model_len=128, kv_pool_tokens=1024)
    a = fp32.generate(PROMPTS, params)
    b = bf16.generate(PROMPTS, params)
    # agreement of the greedy continuation up to the first divergence, averaged over prompts
    agree = []
    for x, y in zip(a, b):
        same = next((i for i, (s, t) in enumerate(zip(x.token_ids, y.token_ids)) if s != t), 16)
        agree.append(same / 16)
    record_property("bf16_prefix_agreement", sum(agree) / len(agree))
    print(f"bf16 greedy prefix agreement with fp32: {sum(agree) / len(agree):.2f}")
    assert sum(agree) / len(agree) >= 0.5
