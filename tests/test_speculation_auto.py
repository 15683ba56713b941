"""speculative = "auto", the default: n-gram lookup where a verify row is exact and cheap (a CPU, an
attention-only model without experts, every linear weight quantized: the GGUF presets), off elsewhere;
greedy output the same as with it off."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from engine import LLM, SamplingParams
from engine.builder import resolve_speculative
from engine.config import EngineConfig

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
REPEATED = [[3, 4] * 15, [7, 8, 9, 10, 11] * 6]      # the random models fall into loops on these


def _model(state=None, experts=0, quantized=True):
    return SimpleNamespace(state_shape=state, cfg=SimpleNamespace(num_experts=experts),
                           linears=SimpleNamespace(all_quantized=quantized))


@pytest.mark.parametrize("device, model, keys, method", [
    (CPU, _model(), {}, "ngram"),
    (CPU, _model(quantized=False), {}, "none"),
    (CPU, _model(state=object()), {}, "none"),                  # a hybrid
    (CPU, _model(experts=8), {}, "none"),
    (CUDA, _model(), {}, "none"),
    (CPU, _model(), {"overlap_scheduling": "on"}, "none"),
    (CPU, _model(quantized=False), {"speculative": "ngram"}, "ngram"),
    (CPU, _model(), {"speculative": "none"}, "none"),
    (CPU, _model(quantized=False), {"draft_model": "a-draft"}, "draft"),
])
def test_auto_is_ngram_only_where_a_verify_row_is_exact(device, model, keys, method):
    assert resolve_speculative(EngineConfig(**keys), device, model) == method


def test_the_default_speculates_on_quantized_weights_and_keeps_greedy_output(tiny_checkpoint):
    path = str(tiny_checkpoint("qwen3", tied=False, heads=8, kv_heads=2, head_dim=32, max_pos=2048))
    common = dict(model=path, dtype="float32", max_model_len=256, kv_pool_tokens=4096)
    auto, off = LLM(**common, quantization="int4"), LLM(**common, quantization="int4", speculative="none")
    dense = LLM(**common)
    assert (auto.engine.speculative, off.engine.speculative, dense.engine.speculative) == ("ngram", "none", "none")
    assert auto.engine.model.linears.all_quantized and not dense.engine.model.linears.all_quantized
    greedy = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    assert [o.token_ids for o in auto.generate(REPEATED, greedy)] == \
        [o.token_ids for o in off.generate(REPEATED, greedy)]
    stats = auto.engine.scheduler.stats()
    assert 0 < stats.spec_accepted_tokens_total <= stats.spec_proposed_tokens_total
    assert dense.engine.scheduler.stats().spec_proposed_tokens_total == 0
