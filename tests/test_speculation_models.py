"""N-gram speculation on tiny fp32 models: greedy output identical with speculation on and off
(Qwen3, Qwen2, Llama, and the hybrids Qwen3.5 and Qwen3-Next, whose recurrent state rolls back;
solo, batched, a prefill arriving mid-run, preemption), equal to transformers, seeded draws
reproducible, logprobs and stop strings unchanged, and what is refused."""
from __future__ import annotations

import time

import pytest
import torch
from fake_engine import record_plans
from conftest import REPEATING_HYBRIDS
from tiny_models import hf_hybrid_model, hf_model

from engine import LLM, SamplingParams
from engine.builder import build_speculator
from engine.config import ConfigError, EngineConfig
from engine.grammar import Grammar

GREEDY = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
# repeated runs of ids: the random models fall into loops of their own on these, which n-gram
# lookup proposes, and leave them again, which it gets wrong
REPEATED = [3, 4] * 15
PROMPTS = [REPEATED, [7, 8, 9, 10, 11] * 6, list(range(30, 50)) * 3]


def _path(name: str, tiny_checkpoint, repeating_hybrid) -> str:
    if name in REPEATING_HYBRIDS:
        return repeating_hybrid(name)
    return str(tiny_checkpoint(name, tied=False, heads=8, kv_heads=2, head_dim=32, max_pos=2048))


@pytest.fixture(scope="module", params=["qwen3", "qwen2", "llama", *REPEATING_HYBRIDS])
def model_path(request, tiny_checkpoint, repeating_hybrid):
    return _path(request.param, tiny_checkpoint, repeating_hybrid)


def _llm(path, **kw):
    kw.setdefault("ngram_min", 2)       # the prompts' loops give lookups of 2 tokens both outcomes
    kw.setdefault("kv_pool_tokens", 4096)
    kw.setdefault("max_model_len", 256)
    return LLM(model=path, dtype="float32", **kw)


def _ids(outs):
    return [o.token_ids for o in outs]


def _verified(llm) -> tuple[int, int]:
    st = llm.engine.scheduler.stats()
    return st.spec_proposed_tokens_total, st.spec_accepted_tokens_total


def test_greedy_output_is_the_same_with_speculation_solo_and_batched(model_path):
    off, on = _llm(model_path), _llm(model_path, speculative="ngram")
    plans = record_plans(on.engine)
    assert _ids(on.generate(PROMPTS[:1], GREEDY)) == _ids(off.generate(PROMPTS[:1], GREEDY))
    assert _ids(on.generate(PROMPTS, GREEDY)) == _ids(off.generate(PROMPTS, GREEDY))
    proposed, accepted = _verified(on)
    assert 0 < accepted < proposed            # acceptances and rejections both happened
    assert any(len(r.token_ids) > 1 and r.kind.value == "decode" for p, _ in plans for r in p.rows)
    assert on.engine.scheduler.stats().blocks_used == 0


def arriving_mid_run(llm, prompts, params) -> list[list[int]]:
    """The first prompt alone for a few steps, then the others arrive; every reply's tokens."""
    loop = llm.engine.loop
    first = loop.submit(prompts[0], params, bounded=False)
    for _ in range(6):
        loop.run_once()
    rest = [loop.submit(p, params, bounded=False) for p in prompts[1:]]
    loop.run_until_idle()
    return [h.result().token_ids for h in [first, *rest]]


def test_a_prefill_arriving_mid_run_and_preemption_keep_greedy_output(model_path):
    def run(llm):
        return arriving_mid_run(llm, PROMPTS, GREEDY)

    alone = _ids(_llm(model_path).generate(PROMPTS, GREEDY))
    mid = _llm(model_path, speculative="ngram")
    assert run(mid) == alone and _verified(mid)[1] > 0
    tight = _llm(model_path, speculative="ngram", kv_pool_tokens=176, max_model_len=128,
                 max_concurrency=3)
    assert run(tight) == alone
    st = tight.engine.scheduler.stats()
    assert st.preemptions_total > 0 and st.spec_accepted_tokens_total > 0 and st.blocks_used == 0


@pytest.mark.parametrize("name", ["qwen3", "qwen3_5"])
def test_plans_with_verify_rows_replayed_into_a_new_engine_reproduce_its_state(name, tiny_checkpoint,
                                                                               repeating_hybrid):
    """Rollbacks travel in the plans: the log alone rebuilds results, tables, the K/V pool and (hybrid)
    the recurrent-state slots."""
    path = _path(name, tiny_checkpoint, repeating_hybrid)
    small = dict(kv_pool_tokens=176, max_model_len=128, max_concurrency=3, block_size=8)
    llm = _llm(path, speculative="ngram", **small)
    log = record_plans(llm.engine)
    llm.generate(PROMPTS, GREEDY)
    st = llm.engine.scheduler.stats()
    assert st.preemptions_total > 0 and 0 < st.spec_accepted_tokens_total < st.spec_proposed_tokens_total
    if name not in REPEATING_HYBRIDS:       # their few rejections need not reach past a block
        assert any(r.drop_blocks for p, _ in log for r in p.rows)
    fresh = _llm(path, **small).engine.runner
    for plan, result in log:
        assert fresh.execute(plan) == result, f"step {plan.step}"
    old = llm.engine.runner
    assert {r: (v.block_table, v.computed, v.floor) for r, v in fresh.ledger.records.items()} == \
        {r: (v.block_table, v.computed, v.floor) for r, v in old.ledger.records.items()}
    states = (fresh.state_pool.layers, old.state_pool.layers) if old.state_pool else ([], [])
    for a, b in zip(fresh.pool.layers + states[0], old.pool.layers + states[1]):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("name", ["qwen3", *REPEATING_HYBRIDS])
def test_speculative_greedy_equals_transformers(name, tiny_checkpoint, repeating_hybrid):
    path = _path(name, tiny_checkpoint, repeating_hybrid)
    hf = hf_hybrid_model(path) if name in REPEATING_HYBRIDS else hf_model(path)
    llm = _llm(path, speculative="ngram")
    n = 24
    got = llm.generate([REPEATED], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))[0].token_ids
    ids, want = list(REPEATED), []
    with torch.no_grad():
        for _ in range(n):
            want.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
            ids.append(want[-1])
    assert got == want and _verified(llm)[0] > 0


def test_seeded_draws_repeat_and_match_the_run_without_speculation(model_path):
    # a low temperature keeps the output repetitive enough to be proposed
    params = SamplingParams(temperature=0.3, top_k=3, max_tokens=40, ignore_eos=True, seed=7)
    on = _llm(model_path, speculative="ngram")
    first, again = _ids(on.generate(PROMPTS, params)), _ids(on.generate(PROMPTS, params))
    assert first == again and _verified(on)[0] > 0
    # a seeded draw depends on (seed, token index) only, so speculation does not change it
    assert first == _ids(_llm(model_path).generate(PROMPTS, params))


def test_logprobs_and_stop_strings_are_unchanged(model_path):
    """Logprobs of accepted tokens are the model's; stop strings end the output where they end
    without speculation."""
    off, on = _llm(model_path), _llm(model_path, speculative="ngram")
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=2)
    outs_off, outs_on = off.generate(PROMPTS, params), on.generate(PROMPTS, params)
    assert _ids(outs_off) == _ids(outs_on) and _verified(on)[1] > 0
    for a, b in zip(outs_off, outs_on):
        for (ta, la, topa), (tb, lb, topb) in zip(a.logprobs, b.logprobs, strict=True):
            assert ta == tb and la == pytest.approx(lb, abs=1e-4)
            assert [t for t, _ in topa] == [t for t, _ in topb]
    loop, full = on.engine.loop, outs_off[0].token_ids
    for cut in (12, 24, 36):           # tests/test_speculation.py puts one inside a run for sure
        params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True,
                                stop=[off.tokenizer.decode(full[cut:cut + 2])])
        want = off.generate([PROMPTS[0]], params)[0]
        handle = loop.submit(PROMPTS[0], params, bounded=False)
        loop.run_until_idle()
        deltas = list(handle)
        assert "".join(d.text for d in deltas) == want.text and want.finish_reason.value == "stop"
        assert handle.request.output_token_ids == want.token_ids == [t for d in deltas for t in d.token_ids]
        assert deltas[-1].completion_tokens == len(want.token_ids)
    assert on.engine.scheduler.stats().blocks_used == 0


def test_penalised_requests_get_no_proposals(model_path):
    on = _llm(model_path, speculative="ngram")
    plans = record_plans(on.engine)
    on.generate([REPEATED], SamplingParams(temperature=0, max_tokens=20, repetition_penalty=1.2))
    assert all(r.num_draft == 0 for p, _ in plans for r in p.rows) and _verified(on) == (0, 0)


def test_a_lazy_grammar_keeps_greedy_output_and_its_proposals_stop_before_the_trigger(tiny_checkpoint,
                                                                                   repeating_hybrid):
    """A lazy grammar's requests still get n-gram proposals, cut before the trigger: after it the
    grammar holds the draws, so output is the same with speculation on and off."""
    path = _path("qwen3", tiny_checkpoint, repeating_hybrid)
    off, on = _llm(path), _llm(path, speculative="ngram")
    trigger = on.tokenizer.encode("<|im_start|>")[0]
    # a bias that makes the random model write the trigger now and then, and loop between
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, logit_bias={trigger: 4.0},
                            grammar=Grammar("lark", 'start: " ab"', trigger="<|im_start|>"))
    prompts = [[5, 6, trigger, 7] * 8, [9, trigger] * 12]
    plans = record_plans(on.engine)
    outs = _ids(on.generate(prompts, params))
    assert outs == _ids(off.generate(prompts, params))
    assert any(trigger in ids for ids in outs)          # the grammar took hold
    rows = [r for p, _ in plans for r in p.rows if r.num_draft]
    assert rows and all(trigger not in r.token_ids[1:] for r in rows) and _verified(on)[1] > 0


def test_what_speculation_refuses():
    assert build_speculator("none", EngineConfig()) is None
    with pytest.raises(ConfigError, match="ngram_min = 5 is more than ngram_max = 4"):
        EngineConfig(ngram_min=5)
    with pytest.raises(ConfigError, match='speculative = "eagle": must be one of "auto", "none", "ngram", "draft"'):
        EngineConfig(speculative="eagle")


def test_metrics_props_and_the_request_table_show_the_counters(tiny_checkpoint):
    from fastapi.testclient import TestClient

    from engine.config import ServerConfig
    from server.app import create_app

    path = str(tiny_checkpoint("qwen3", tied=False, heads=8, kv_heads=2, head_dim=32, max_pos=2048))
    # the default, auto: ngram for weights that are all quantized; /props names the method served
    cfg = EngineConfig(model=path, dtype="float32", quantization="int4", max_model_len=256, kv_pool_tokens=4096)
    auth = {"Authorization": "Bearer admin"}
    with TestClient(create_app(cfg, ServerConfig(admin_key="admin"))) as http:
        while http.get("/health").status_code != 200:
            time.sleep(0.05)
        body = {"prompt": REPEATED, "max_tokens": 48, "temperature": 0, "ignore_eos": True}
        assert http.post("/v1/completions", json=body).status_code == 200
        metrics = {line.split(" ")[0]: float(line.split(" ")[1]) for line in http.get("/metrics").text.splitlines()
                   if line.startswith("pagedserve:spec_decode")}
        props = http.get("/props").json()["speculative"]
        stats = http.get("/v1/requests", headers=auth).json()["stats"]
    proposed, accepted = metrics["pagedserve:spec_decode_num_draft_tokens_total"], \
        metrics["pagedserve:spec_decode_num_accepted_tokens_total"]
    assert 0 < accepted < proposed and metrics["pagedserve:spec_decode_num_drafts_total"] > 0
    assert metrics["pagedserve:spec_decode_acceptance_rate"] == pytest.approx(accepted / proposed)
    assert props["method"] == "ngram" and (props["proposed_tokens"], props["accepted_tokens"]) == (proposed, accepted)
    assert stats["spec_accepted_tokens_total"] == accepted
    mean = metrics["pagedserve:spec_decode_mean_acceptance_length"]
    assert stats["spec_mean_acceptance_length"] == pytest.approx(mean) and mean > 1
