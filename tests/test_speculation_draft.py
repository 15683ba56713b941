"""Draft-model speculation on tiny fp32 models: greedy output identical with and without it (Qwen3,
Qwen2, Llama; solo, batched, a prefill arriving mid-run, preemption) and equal to transformers;
the target as its own draft (nearly every proposal accepted: the bookkeeping) and an unrelated
random draft (nearly none: the rollback); seeded draws unchanged; the plans replay; what is refused."""
from __future__ import annotations

import pytest
import torch
from fake_engine import record_plans
from test_speculation_models import _ids, arriving_mid_run
from test_speculation_models import _verified as _rates
from tiny_models import hf_model

from engine import LLM, SamplingParams
from engine.builder import resolve_quantization
from engine.config import ConfigError, EngineConfig
from engine.kv.pool import KVShape, plan_num_blocks

GREEDY = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
PROMPTS = [[3, 4] * 15, [7, 8, 9, 10, 11] * 6, list(range(30, 50)) * 3]
SHAPE = dict(tied=False, heads=8, kv_heads=2, head_dim=32, max_pos=2048)


@pytest.fixture(scope="module", params=["qwen3", "qwen2", "llama"])
def target(request, tiny_checkpoint):
    return str(tiny_checkpoint(request.param, **SHAPE))


@pytest.fixture(scope="module")
def stranger(tiny_checkpoint):
    """A random model of another shape and seed with the same vocabulary: its proposals are wrong."""
    return str(tiny_checkpoint("qwen3", tied=True, hidden=32, layers=1, heads=2, kv_heads=1, max_pos=2048,
                               seed=5))


def _llm(path, p_min=0.0, **kw):
    """p_min 0: a random tiny model is never as sure of a token as a real draft is. The draft keeps its
    weights as they are (not int4, the CPU default) so that a self-draft proposes what the target draws."""
    kw.setdefault("kv_pool_tokens", 4096)
    kw.setdefault("draft_quantization", "none")
    kw.setdefault("max_model_len", 256)
    llm = LLM(model=path, dtype="float32", **kw)
    if llm.engine.draft is not None:
        llm.engine.draft.p_min = p_min
    return llm


def test_a_self_draft_is_accepted_and_changes_no_greedy_output(target):
    off, on = _llm(target), _llm(target, draft_model=target)
    assert on.engine.config.speculative == "draft"          # naming a draft model turns it on
    plans = record_plans(on.engine)
    assert _ids(on.generate(PROMPTS[:1], GREEDY)) == _ids(off.generate(PROMPTS[:1], GREEDY))
    assert _ids(on.generate(PROMPTS, GREEDY)) == _ids(off.generate(PROMPTS, GREEDY))
    proposed, accepted = _rates(on)
    # the same weights propose what the target draws, up to the rounding of other batch shapes
    assert proposed > 40 and accepted >= 0.9 * proposed
    assert any(r.draft_k for p, _ in plans for r in p.rows)
    counts = [(len(o.proposals), r.draft_k) for p, res in plans for r, o in zip(p.rows, res.rows) if r.draft_k]
    assert all(n <= k for n, k in counts) and sum(n == k for n, k in counts) > 0.8 * len(counts)
    assert on.engine.scheduler.stats().blocks_used == 0


def test_the_draft_reads_only_for_rows_that_ask_and_catches_up_in_chunks(target):
    """Steps without proposals run no draft forward; a backlog longer than a step's reading (here
    8 tokens) is read over several steps, the row getting no proposals until it is caught up."""
    on = _llm(target, draft_model=target)
    draft, execute = on.engine.draft, on.engine.runner.execute
    draft.read_per_step = 8
    forwards, greedy = [], draft._greedy
    draft._greedy = lambda batch, slots: forwards.append(batch.input_ids.numel()) or greedy(batch, slots)
    plans = []
    on.engine.runner.execute = lambda plan: plans.append((plan, len(forwards))) or execute(plan)
    assert _ids(on.generate(PROMPTS, GREEDY)) == _ids(_llm(target).generate(PROMPTS, GREEDY))
    ends = [n for _, n in plans[1:]] + [len(forwards)]
    for (plan, before), after in zip(plans, ends):
        asked = any(r.draft_k for r in plan.rows)
        assert (after > before) == asked and all(n <= 8 for n in forwards[before:after])
    assert _rates(on)[1] >= 0.9 * _rates(on)[0] > 0


def test_a_cached_prefix_is_read_by_the_draft_once(target):
    """A prompt computed without proposals (one token: no decode step) leaves no draft K/V in its
    blocks: the request that later hits them gets the cached tokens in its fresh row and the draft
    reads them. A third request on the same prompt finds those blocks read and skips them."""
    on = _llm(target, draft_model=target)
    draft = on.engine.draft
    read, greedy = [], draft._greedy
    draft._greedy = lambda batch, slots: read.append(batch.input_ids.numel()) or greedy(batch, slots)
    on.generate([PROMPTS[2]], SamplingParams(temperature=0, max_tokens=1))
    plans = record_plans(on.engine)
    want = _ids(_llm(target).generate([PROMPTS[2]], GREEDY))
    assert _ids(on.generate([PROMPTS[2]], GREEDY)) == want
    fresh = plans[0][0].rows[0]
    assert fresh.start_pos >= 32 and fresh.cached_token_ids == tuple(PROMPTS[2][:fresh.start_pos])
    assert read[0] > fresh.start_pos            # the cached prefix, then the row's own tokens
    proposed, accepted = _rates(on)
    assert proposed > 20 and accepted >= 0.9 * proposed
    read.clear()
    assert _ids(on.generate([PROMPTS[2]], GREEDY)) == want
    assert read[0] <= len(PROMPTS[2]) - fresh.start_pos + 16 and _rates(on)[1] > accepted


def test_a_rows_proposals_end_with_the_first_token_the_draft_is_unsure_of(target):
    unsure = _llm(target, draft_model=target, p_min=1.01)      # no token is that likely
    plans = record_plans(unsure.engine)
    assert _ids(unsure.generate(PROMPTS[:1], GREEDY)) == _ids(_llm(target).generate(PROMPTS[:1], GREEDY))
    asked = [(r.draft_k, len(o.proposals)) for p, res in plans for r, o in zip(p.rows, res.rows) if r.draft_k]
    assert max(k for k, _ in asked) > 1                        # rows asked for more than one
    assert {n for _, n in asked} <= {0, 1} and sum(n for _, n in asked) > 20    # that one is proposed
    proposed, accepted = _rates(unsure)
    assert proposed > 20 and accepted >= 0.9 * proposed


def test_an_unrelated_draft_is_rejected_and_changes_no_greedy_output(target, stranger):
    on = _llm(target, draft_model=stranger)
    assert _ids(on.generate(PROMPTS, GREEDY)) == _ids(_llm(target).generate(PROMPTS, GREEDY))
    proposed, accepted = _rates(on)
    assert proposed > 0 and accepted < 0.5 * proposed


def test_a_prefill_arriving_mid_run_and_preemption_keep_greedy_output(target, stranger):
    def run(llm):
        return arriving_mid_run(llm, PROMPTS, GREEDY)

    alone = _ids(_llm(target).generate(PROMPTS, GREEDY))
    mid = _llm(target, draft_model=target)
    assert run(mid) == alone and _rates(mid)[1] > 0
    for draft in (target, stranger):
        tight = _llm(target, draft_model=draft, kv_pool_tokens=144, max_model_len=128, max_concurrency=3)
        assert run(tight) == alone
        st = tight.engine.scheduler.stats()
        assert st.preemptions_total > 0 and st.spec_proposed_tokens_total > 0 and st.blocks_used == 0


def test_draft_speculation_greedy_equals_transformers(tiny_checkpoint, stranger):
    path = str(tiny_checkpoint("qwen3", **SHAPE))
    hf, n = hf_model(path), 24
    ids, want = list(PROMPTS[0]), []
    with torch.no_grad():
        for _ in range(n):
            want.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
            ids.append(want[-1])
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    for draft in (path, stranger):
        llm = _llm(path, draft_model=draft)
        assert llm.generate([PROMPTS[0]], params)[0].token_ids == want and _rates(llm)[0] > 0


def test_seeded_draws_repeat_and_match_the_run_without_speculation(target):
    params = SamplingParams(temperature=0.3, top_k=3, max_tokens=30, ignore_eos=True, seed=7)
    on = _llm(target, draft_model=target)
    first = _ids(on.generate(PROMPTS, params))
    assert first == _ids(on.generate(PROMPTS, params)) and _rates(on)[1] > 0
    assert first == _ids(_llm(target).generate(PROMPTS, params))


def test_plans_with_drafted_rows_replayed_into_a_new_engine_reproduce_its_state(tiny_checkpoint, stranger):
    """The draft runs inside the engine: the same plans give the same proposals, results and K/V."""
    path = str(tiny_checkpoint("qwen3", **SHAPE))
    small = dict(kv_pool_tokens=176, max_model_len=128, max_concurrency=3, block_size=8, draft_model=stranger)
    llm = _llm(path, **small)
    log = record_plans(llm.engine)
    llm.generate(PROMPTS, GREEDY)
    assert llm.engine.scheduler.stats().preemptions_total > 0
    assert any(r.drop_blocks for p, _ in log for r in p.rows)
    fresh = _llm(path, **small).engine
    for plan, result in log:
        assert fresh.runner.execute(plan) == result, f"step {plan.step}"
    for new, old in ((fresh.pool, llm.engine.pool), (fresh.draft.pool, llm.engine.draft.pool)):
        for a, b in zip(new.layers, old.layers):
            assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_the_pool_counts_the_draft_k_v_under_the_same_blocks(target, stranger, monkeypatch):
    from engine.client import EngineClient

    client = EngineClient(_llm(target, draft_model=stranger).engine)
    try:
        engine, info = client.engine, client.info()
    finally:
        client.close()
    assert engine.draft.pool.num_blocks == engine.pool.num_blocks == info.num_blocks
    assert (engine.draft.pool.shape.num_layers, engine.draft.pool.shape.kv_heads) == (1, 1)
    assert info.kv_pool_bytes == engine.pool.nbytes + engine.draft.pool.nbytes
    # where memory caps the pool, a draft as big as the target halves the blocks
    monkeypatch.setattr("engine.kv.pool.available_bytes", lambda device: 2 ** 31)
    shape = KVShape(32, 8, 128, 16, torch.float32)          # 4 MiB a block
    sized = dict(kv_pool_tokens=0, max_concurrency=8, max_model_len=1024, device=torch.device("cpu"))
    assert plan_num_blocks(shape, **sized) == 256 and plan_num_blocks(shape, draft=shape, **sized) == 128


def test_what_a_draft_model_needs(tiny_checkpoint, target):
    with pytest.raises(ConfigError, match='"draft" needs a draft_model'):
        EngineConfig(speculative="draft")
    with pytest.raises(ConfigError, match='speculative = "ngram" with draft_model'):
        EngineConfig(speculative="ngram", draft_model="x")
    other_vocab = str(tiny_checkpoint("qwen3", vocab=64 * 3000, **SHAPE))
    with pytest.raises(ConfigError, match=r"vocabulary has 192,000 tokens and the target's \d[\d,]+"):
        _llm(target, draft_model=other_vocab)
    short = str(tiny_checkpoint("qwen3", **(SHAPE | dict(max_pos=128))))
    with pytest.raises(ConfigError, match="handles 128 positions, fewer than max_model_len = 256"):
        _llm(target, draft_model=short)


def test_the_draft_loads_int4_by_default_on_cpus_and_changes_no_greedy_output(target):
    on = _llm(target, draft_model=target, draft_quantization="auto")
    draft, target_formats = on.engine.draft.model.linears.formats, on.engine.model.linears.formats
    assert all(name.startswith("int4 ") for name in draft) and sum(draft.values()) == sum(target_formats.values())
    assert list(target_formats) == ["float32"]              # the target as it was
    assert _ids(on.generate(PROMPTS, GREEDY)) == _ids(_llm(target).generate(PROMPTS, GREEDY))
    proposed, accepted = _rates(on)
    assert proposed > 0 and accepted > 0                    # close to the target, not equal to it
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_quantization(EngineConfig(draft_quantization="auto"), cpu, "draft_quantization") == "int4"
    assert resolve_quantization(EngineConfig(draft_quantization="auto"), cuda, "draft_quantization") == "none"
    assert resolve_quantization(EngineConfig(draft_quantization="none"), cpu, "draft_quantization") == "none"
    with pytest.raises(ConfigError, match='draft_quantization = "int4" runs on CPUs only'):
        resolve_quantization(EngineConfig(draft_quantization="int4"), cuda, "draft_quantization")


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    """A Qwen3.5-shaped hybrid whose tied, scaled-up embeddings make greedy output run in repeats."""
    from tiny_models import make_hybrid_checkpoint

    return str(make_hybrid_checkpoint(tmp_path_factory.mktemp("hybrid"), "qwen3_5", tied=True, embed_scale=8.0,
                                      max_pos=2048))


@pytest.mark.parametrize("pair", ["hybrid self-draft", "hybrid target, dense draft", "dense target, hybrid draft"])
def test_hybrid_models_draft_and_are_drafted_for_without_changing_greedy_output(pair, hybrid, tiny_checkpoint):
    dense = str(tiny_checkpoint("qwen3", **SHAPE))
    target, draft = {"hybrid self-draft": (hybrid, hybrid), "hybrid target, dense draft": (hybrid, dense),
                     "dense target, hybrid draft": (dense, hybrid)}[pair]
    on = _llm(target, draft_model=draft)
    plain = _ids(_llm(target).generate(PROMPTS, GREEDY))
    assert _ids(on.generate(PROMPTS[:1], GREEDY)) == plain[:1]
    assert _ids(on.generate(PROMPTS, GREEDY)) == plain
    proposed, accepted = _rates(on)
    assert proposed > 0 and on.engine.scheduler.stats().blocks_used == 0
    if target == draft:     # the draft's own state (slot, scratch copy, backlog) is right
        assert accepted >= 0.9 * proposed
