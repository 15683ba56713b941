"""Hybrid (Gated DeltaNet + gated attention) and MoE models against transformers (the oracle) in fp32:
logits and 32 greedy tokens per architecture, prompts split over steps at odd boundaries, batched runs,
and a state slot freed by a cancel and reused."""
from __future__ import annotations

import inspect

import pytest
import torch

from engine import LLM, SamplingParams
from engine.kv.pool import KVPool, KVShape, StatePool
from engine.loading.checkpoint import open_checkpoint
from engine.loading.model_config import parse_model_config
from engine.models.batch import ForwardBatch
from engine.models.qwen3_5 import HybridDecoder
from engine.runner import PrefillBudget
from tiny_models import hf_hybrid_model, make_hybrid_checkpoint, whole_prompt_batch

ARCHS = {
    "qwen3_5": dict(arch="qwen3_5"),
    "qwen3_5-conditional-generation-tied": dict(arch="qwen3_5_vl", tied=True),
    "qwen3_next-fused-proj-moe": dict(arch="qwen3_next", tied=True, linear_heads=(2, 2)),
    "qwen3_5_moe": dict(arch="qwen3_5_moe", layer_types=("linear_attention",) * 3 + ("full_attention",)),
    "qwen3_moe-dense-attention": dict(arch="qwen3_moe", layer_types=("full_attention",) * 2, seed=1),
}
PROMPTS = ["The quick brown fox", "模型把每个请求的键和值"]
GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)


@pytest.fixture(scope="session")
def hybrid_checkpoint(tmp_path_factory):
    built = {}
    signature = inspect.signature(make_hybrid_checkpoint)

    def build(**kwargs):
        bound = signature.bind(None, **kwargs)
        bound.apply_defaults()
        key = repr(sorted((k, v) for k, v in bound.arguments.items() if k != "directory"))
        if key not in built:
            built[key] = make_hybrid_checkpoint(tmp_path_factory.mktemp("hybrid"), **kwargs)
        return built[key]

    return build


@pytest.fixture(params=list(ARCHS), scope="module")
def variant(request, hybrid_checkpoint):
    return hybrid_checkpoint(**ARCHS[request.param])


def _hf_greedy(hf, ids: list[int], n: int) -> list[int]:
    """transformers' own greedy generation (its prefill, then its recurrent decode path)."""
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(ids):].tolist()


def test_prefill_logits_match_transformers(variant):
    ckpt = open_checkpoint(variant)
    cfg = parse_model_config(ckpt.config)
    model = HybridDecoder(cfg, ckpt, torch.float32, torch.device("cpu"))
    pool = KVPool(KVShape(model.num_kv_layers, cfg.num_kv_heads, cfg.head_dim, 16, torch.float32), 8,
                  torch.device("cpu"))
    states = StatePool(model.state_shape, 3, torch.device("cpu")).layers if model.state_shape else ()
    ids = torch.randint(0, cfg.vocab_size, (70,), generator=torch.Generator().manual_seed(1))  # > one 64-chunk
    batch = whole_prompt_batch(ids)
    with torch.inference_mode():
        ours = model.logits(model.forward(batch, pool.layers, states, torch.tensor([2], dtype=torch.int32)))
        theirs = hf_hybrid_model(variant)(ids[None]).logits[0]
    torch.testing.assert_close(ours, theirs, atol=2e-4, rtol=2e-4)


def test_greedy_tokens_match_transformers(variant):
    llm = LLM(model=str(variant), dtype="float32", max_model_len=128, kv_pool_tokens=1024)
    hf = hf_hybrid_model(variant)
    outs = llm.generate(PROMPTS, GREEDY)
    for prompt, out in zip(PROMPTS, outs):
        assert out.token_ids == _hf_greedy(hf, llm.tokenizer.encode(prompt), 32), prompt
    stats = llm.engine.scheduler.stats()
    assert stats.blocks_used == 0 and stats.slots_used == 0
    assert len(set(outs[0].token_ids)) > 3          # the random model says something, not one token


@pytest.mark.parametrize("name", ["qwen3_5", "qwen3_next-fused-proj-moe"])
def test_chunked_batched_prompts_equal_unchunked_and_alone(hybrid_checkpoint, name):
    """Prompts of 15/16/17/70 tokens batched together and fed in chunks of at most 13 tokens (cut at
    odd places, next to decode rows) give transformers' full-sequence greedy tokens, and each prompt
    alone gives the same."""
    path = hybrid_checkpoint(**ARCHS[name])
    hf = hf_hybrid_model(path)
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 400, (n,), generator=gen).tolist() for n in (15, 16, 17, 70)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    llm = LLM(model=str(path), dtype="float32", max_model_len=128, kv_pool_tokens=2048, max_concurrency=4)
    llm.engine.runner.budget = PrefillBudget(idle_total=13, mixed_total=7, quantum=5)
    together = llm.generate(prompts, params)
    for p, out in zip(prompts, together):
        assert out.token_ids == _hf_greedy(hf, p, 10)
    alone = [llm.generate([p], params)[0] for p in prompts]
    assert [o.token_ids for o in alone] == [o.token_ids for o in together]
    unchunked = LLM(model=str(path), dtype="float32", max_model_len=128, kv_pool_tokens=2048)
    assert [o.token_ids for o in unchunked.generate(prompts, params)] == [o.token_ids for o in together]


def test_slot_freed_by_cancel_and_reused_matches_fresh_engine(hybrid_checkpoint):
    """One state slot: a cancelled request leaves its state behind; the next request must not see it."""
    path = hybrid_checkpoint(**ARCHS["qwen3_5"])
    make = dict(model=str(path), dtype="float32", max_model_len=128, kv_pool_tokens=1024, max_concurrency=1,
                state_spare_slots=0)
    llm = LLM(**make)
    assert llm.engine.runner.limits().num_state_slots == 1
    loop = llm.engine.loop
    first = loop.submit(llm.tokenizer.encode("Continuous batching lets new requests join"),
                        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), bounded=False)
    for _ in range(6):
        loop.run_once()
    assert any(conv.abs().sum() > 0 for conv, _ in llm.engine.state_pool.layers)   # the slot holds state
    first.cancel()
    loop.run_until_idle()
    assert first.result().finish_reason.value == "cancelled"
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    reused = llm.generate(["Der schnelle braune Fuchs"], params)[0]
    fresh = LLM(**make).generate(["Der schnelle braune Fuchs"], params)[0]
    assert reused.token_ids == fresh.token_ids
    assert reused.token_ids == _hf_greedy(hf_hybrid_model(path), llm.tokenizer.encode("Der schnelle braune Fuchs"), 16)


def test_state_slots_are_counted_in_the_pool_budget(hybrid_checkpoint, monkeypatch):
    from engine.kv import pool as pool_module

    path = hybrid_checkpoint(**ARCHS["qwen3_5"])
    llm = LLM(model=str(path), dtype="float32", max_model_len=128, kv_pool_tokens=1024, max_concurrency=3,
              state_spare_slots=0)
    engine = llm.engine
    cfg = engine.model_config
    assert engine.pool.shape.num_layers == len(cfg.attention_layers) == 2   # K/V only for full attention
    assert engine.state_pool.num_slots == 3 and len(engine.state_pool.layers) == len(cfg.linear_layers) == 2
    conv, ssm = engine.state_pool.layers[0]
    key_dim, value_dim = 2 * 16, 4 * 8
    assert conv.shape == (3, 2 * key_dim + value_dim, 3) and ssm.shape == (3, 4, 16, 8)
    per_slot = engine.state_pool.shape.bytes_per_slot
    assert per_slot == 2 * (conv[0].numel() * 4 + ssm[0].numel() * 4)
    # sized from (GPU) memory: the slots' bytes come off the usable memory before blocks are counted
    free = 10 * 2**30
    monkeypatch.setattr(pool_module, "available_bytes", lambda device: free)
    shape = engine.pool.shape
    kwargs = dict(kv_pool_tokens=0, max_concurrency=10**6, max_model_len=128, device=torch.device("cuda"))
    usable = free - free // 10
    assert pool_module.plan_num_blocks(shape, **kwargs) == usable // shape.bytes_per_block
    assert (pool_module.plan_num_blocks(shape, state_bytes=per_slot * 5000, **kwargs)
            == (usable - per_slot * 5000) // shape.bytes_per_block)


def test_fused_expert_tensors_load_like_per_expert_ones(hybrid_checkpoint, tmp_path):
    """Checkpoints may store experts stacked (`experts.gate_up_proj` [E, 2I, H], `experts.down_proj`
    [E, H, I]) instead of one tensor set per expert: both layouts give the same model."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    source = hybrid_checkpoint(**ARCHS["qwen3_5_moe"])
    tensors = load_file(source / "model.safetensors")
    cfg = json.loads((source / "config.json").read_text())
    fused = {}
    for i in range(len(cfg["layer_types"])):
        p = f"model.layers.{i}.mlp.experts."
        experts = range(cfg["num_experts"])
        fused[p + "gate_up_proj"] = torch.stack([torch.cat([tensors.pop(f"{p}{e}.gate_proj.weight"),
                                                            tensors.pop(f"{p}{e}.up_proj.weight")]) for e in experts])
        fused[p + "down_proj"] = torch.stack([tensors.pop(f"{p}{e}.down_proj.weight") for e in experts])
    save_file({**tensors, **fused}, tmp_path / "model.safetensors")
    shutil.copy(source / "config.json", tmp_path / "config.json")

    def logits(path):
        ckpt = open_checkpoint(path)
        model = HybridDecoder(parse_model_config(ckpt.config), ckpt, torch.float32, torch.device("cpu"))
        pool = KVPool(KVShape(1, 2, 16, 16, torch.float32), 2, torch.device("cpu"))
        states = StatePool(model.state_shape, 1, torch.device("cpu")).layers
        ids = torch.arange(5, 14)
        batch = ForwardBatch(input_ids=ids, positions=torch.arange(9), slot_mapping=torch.arange(9),
                             block_tables=torch.tensor([[0]], dtype=torch.int32),
                             query_start_loc=torch.tensor([0, 9], dtype=torch.int32),
                             context_lens=torch.tensor([9], dtype=torch.int32), logits_indices=torch.arange(9))
        with torch.inference_mode():
            return model.logits(model.forward(batch, pool.layers, states, torch.tensor([0], dtype=torch.int32)))

    torch.testing.assert_close(logits(tmp_path), logits(source), atol=0, rtol=0)


def _dequantize_in_place(model: HybridDecoder) -> int:
    """Swap every quantized projection for its dequantized values; returns how many there were."""
    from ops.quant_weight import QuantizedWeight

    def dense(w):
        return w.dequantize().to(torch.float32) if isinstance(w, QuantizedWeight) else w
    swapped = 0
    holders = [model] + [layer.attention or layer.linear for layer in model.layers] + [l.mlp for l in model.layers]
    for holder in holders:
        for name in ("lm_head", "qkvg_w", "o_w", "in_w", "out_w", "gate_up", "down"):
            w = getattr(holder, name, None)
            if isinstance(w, QuantizedWeight):
                setattr(holder, name, dense(w))
                swapped += 1
        if getattr(holder, "shared", None) is not None:
            swapped += sum(isinstance(w, QuantizedWeight) for w in holder.shared)
            holder.shared = tuple(map(dense, holder.shared))
    return swapped


@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("arch, extra", [("qwen3_5", {}), ("qwen3_next", dict(linear_heads=(2, 2)))])
def test_quantized_hybrids_run_quant_linear_and_match_their_dequantized_weights(hybrid_checkpoint, arch, extra,
                                                                                 mode, monkeypatch):
    """The hybrid layers' projections take the dense models' path: quantized at load, multiplied by
    quant_linear, and close to the same model on the dequantized weights (whose dense path equals
    transformers: test_prefill_logits_match_transformers)."""
    import engine.models.linear as linear_module
    calls = []
    real = linear_module.quant_linear
    monkeypatch.setattr(linear_module, "quant_linear", lambda *a: calls.append(1) or real(*a))
    # one layer of each kind: the rounding is not compounded through a deep random stack
    path = hybrid_checkpoint(arch=arch, layer_types=("linear_attention", "full_attention"), **extra)
    llm = LLM(model=str(path), quantization=mode, dtype="float32",
              max_model_len=128, kv_pool_tokens=1024)
    assert llm.engine.weights.startswith(mode)
    model, cfg = llm.engine.model, llm.engine.model_config
    ids = torch.randint(0, cfg.vocab_size, (40,), generator=torch.Generator().manual_seed(2))
    runner = llm.engine.runner

    def logits():
        states = runner.state_pool.layers if runner.state_pool else ()
        for layer in states:
            for t in layer:
                t.zero_()
        with torch.inference_mode():
            return model.logits(model.forward(whole_prompt_batch(ids), runner.pool.layers, states,
                                              torch.tensor([0], dtype=torch.int32)))
    quantized = logits()
    assert calls, "no projection went through quant_linear"
    assert _dequantize_in_place(model) > 0
    dense = logits()
    # quant_linear rounds the activations too (as llama.cpp does), and random recurrent models
    # amplify that, so agreement is judged as for the dense models: the same argmax almost
    # everywhere, teacher forced (a mis-assembled weight agrees almost nowhere)
    top1 = (quantized.argmax(-1) == dense.argmax(-1)).float().mean()
    error = (quantized - dense).abs().max() / dense.abs().max()
    print(f"{arch} {mode}: top-1 agreement {top1:.3f}, max logit error {error:.4f} of max |logit|")
    assert top1 >= 0.85
