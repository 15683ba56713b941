"""Speculative decoding without a model: the n-gram proposer, verify rows in the plans (rollback of
computed positions and blocks, in the scheduler and the engine's ledger), the acceptance rule and its
distribution (random workloads: tests/test_speculation_workloads.py)."""
from __future__ import annotations

import gc
import sys
from dataclasses import replace

import pytest
import torch
from fake_engine import OracleProposer, drain, make_request, make_scheduler, tokens

from engine.contracts import (ContractError, Draw, PlanRow, RowKind, RowOutput, StepPlan, StepResult,
                              check_plan, check_result)
from engine.grammar import LazyMatcher
from engine.loop import EngineLoop
from engine.ngram import NgramIndex, NgramProposer
from engine.plan_ledger import PlanLedger
from engine.request import FinishReason, SamplingParams
from engine.sampling import sample
from engine.speculation import DraftProposer, Speculator, accepted_run

GREEDY = SamplingParams(temperature=0)


def _oracle(k=4, error=0.3, vocab=50, seed=0):
    return Speculator(OracleProposer(vocab, error, seed), k)


def _speculating(k: int, error: float, draft: bool) -> dict:
    """make_scheduler arguments: the oracle proposer in the scheduler, or the same proposals from
    the engine's (fake) draft model, in the step that verifies them."""
    if draft:
        return dict(speculator=Speculator(DraftProposer(), k), draft_error=error)
    return dict(speculator=_oracle(k, error))


def _loud(execute):
    """The engine's failed checks (slot state, tables) fail the test: the scheduler would take them
    for step failures."""
    def run(plan):
        try:
            return execute(plan)
        except AssertionError as e:
            pytest.fail(f"step {plan.step}: {e}")
    return run


def _run(specs, speculator=None, **cfg):
    """Requests (prompt length, max_tokens) drained through a FakeEngine; their outputs and reasons."""
    sched, engine, _ = make_scheduler(vocab=50, speculator=speculator, **cfg)
    engine.execute = _loud(engine.execute)
    reqs = [make_request(f"r{i}", n, max_tokens=mt, seed=i) for i, (n, mt) in enumerate(specs)]
    for req in reqs:
        sched.add(req)
    drain(sched)
    return [(r.output_token_ids, r.finish_reason) for r in reqs], sched, engine


# ---- the n-gram proposer ------------------------------------------------------------------------
def test_ngram_proposes_what_followed_the_latest_earlier_occurrence_longest_match_first():
    index = NgramIndex(1, 3)
    assert index.propose([1, 2, 3], 4) == ()                 # nothing occurred before
    assert index.propose([1, 2, 3, 9, 2, 3], 2) == (9, 2)     # "2 3" ended at 3, then came 9, 2
    # a later "3" was followed by 7, but the 3-gram "9 2 3" still decides: longest first
    assert index.propose([1, 2, 3, 9, 2, 3, 9, 5, 3, 7, 9, 2, 3], 3) == (9, 5, 3)
    assert index.propose([1, 2, 3, 9, 2, 3, 9, 5, 3, 7, 9, 2, 3, 4, 4], 3) == (4,)   # the end is near


def test_ngram_proposer_keeps_one_index_per_request():
    proposer = NgramProposer(2, 4)
    a, b = make_request("a", 4), make_request("b", 4)
    a.prompt_token_ids = ()
    for t in (5, 6, 7, 5, 6):
        a.append_output(t)
    assert proposer.propose(a, 3) == (7, 5, 6) and proposer.propose(b, 3) == ()
    proposer.forget("a")
    assert "a" not in proposer._indexes


def _calls(fn) -> int:
    n = 0

    def count(frame, event, arg):
        nonlocal n
        n += event in ("call", "c_call")
    gc.disable()
    sys.setprofile(count)
    fn()
    sys.setprofile(None)
    gc.enable()
    return n


def test_a_proposal_costs_the_same_at_context_100_and_10000():
    """Counted, not timed: after the first proposal indexed the prompt, appending a token and
    proposing does the same calls whatever the context length."""
    counts = []
    for context in (100, 10_004):
        tokens_ = [(i * 7) % 13 for i in range(context)]
        index = NgramIndex(2, 4)
        index.propose(tokens_, 5)
        tokens_.append(tokens_[-13])
        counts.append(_calls(lambda: index.propose(tokens_, 5)))
    assert counts[0] == counts[1]


# ---- the rule and the pace ----------------------------------------------------------------------
def _verify_row(proposals, start=3, rid="a", params=GREEDY, index=0):
    return PlanRow(rid, RowKind.DECODE, (1, *proposals), start, (), None, True, params,
                   sample_index=index, num_draft=len(proposals))


def test_the_run_kept_is_the_matching_prefix_and_one_draw_more():
    row = _verify_row((4, 5, 6))
    out = lambda *t: RowOutput("a", token=t[0], verify=tuple(Draw(x) for x in t[1:]))   # noqa: E731
    assert [d.token for d in accepted_run(row, out(4, 5, 6, 7))] == [4, 5, 6, 7]    # bonus draw
    assert [d.token for d in accepted_run(row, out(4, 9, 6, 7))] == [4, 9]          # correction
    assert [d.token for d in accepted_run(row, out(8, 5, 6, 7))] == [8]


def test_the_proposal_length_adapts_and_turns_off_with_backoff():
    spec = _oracle(k=3)
    req = make_request("a", 4, max_tokens=100)
    full = lambda n: RowOutput("a", token=1, verify=tuple(Draw(1) for _ in range(n)))  # noqa: E731
    assert len(spec._draft(req, 99)) == 3
    spec.accept(_verify_row((1, 1, 1)), full(3))          # all accepted: stays at the cap
    assert spec._paces["a"].k == 3
    spec.accept(_verify_row((1, 2, 2)), full(3))          # one accepted: cut to one more
    assert spec._paces["a"].k == 2 and len(spec._draft(req, 99)) == 2
    spec.accept(_verify_row((1, 1)), full(2))             # all: +1
    assert spec._paces["a"].k == 3
    spec.accept(_verify_row((2, 2)), full(2))             # none: off, sits out one step
    assert spec._draft(req, 99) == () and len(spec._draft(req, 99)) == 1
    spec.accept(_verify_row((2,)), full(1))               # none again: sits out two steps
    assert [len(spec._draft(req, 99)) for _ in range(3)] == [0, 0, 1]
    assert len(spec._draft(req, 2)) == 1                  # the step's budget bounds it too
    assert spec.stats() == dict(spec_proposed_tokens_total=11, spec_accepted_tokens_total=6,
                                spec_verify_rows_total=5)


@pytest.mark.parametrize("params", [SamplingParams(repetition_penalty=1.2),
                                    SamplingParams(min_tokens=3, max_tokens=8)])
def test_requests_whose_draws_depend_on_rolled_back_state_get_no_proposals(params):
    req = make_request("a", 4)
    req.params = params
    assert not _oracle().eligible(req)


class _Fixed:
    """Proposes the same tokens every time."""
    def propose(self, req, k):
        return (3, 7, 9, 11)[:k]

    def forget(self, request_id):
        pass


class _Grammar:
    """An llguidance matcher's surface: accepts anything, never complete."""
    def deep_copy(self):
        return self

    def consume_token(self, token):
        return True

    def is_stopped(self):
        return False


def test_a_lazy_grammar_gets_proposals_cut_before_its_trigger_until_it_begins():
    spec = Speculator(_Fixed(), 4)
    req = make_request("a", 4)
    req.matcher = LazyMatcher(_Grammar(), 7)
    assert spec.eligible(req) and spec._draft(req, 99) == (3,)        # a trigger is only ever a run's last draw
    assert not Speculator(DraftProposer(), 4).eligible(req)            # draft-model proposals are not seen
    assert req.matcher.accept(7) and not req.matcher.dormant
    assert not spec.eligible(req)


# ---- verify rows in the contract and the ledger --------------------------------------------------
def test_check_plan_and_check_result_know_verify_rows():
    row = _verify_row((4, 5))
    plan = StepPlan(1, (row,))
    check_plan(plan, {"a"})
    check_result(plan, StepResult(1, (RowOutput("a", token=4, verify=(Draw(5), Draw(6))),)))
    check_result(plan, StepResult(1, (RowOutput("a", error="boom"),)))
    with pytest.raises(ContractError, match="got 1 draws after proposals for 2"):
        check_result(plan, StepResult(1, (RowOutput("a", token=4, verify=(Draw(5),)),)))
    bad = PlanRow("a", RowKind.PREFILL, (1, 2), 0, (0,), None, False, None, fresh=True, num_draft=1)
    with pytest.raises(ContractError, match="carries proposals but is not a sampling decode row"):
        check_plan(StepPlan(1, (bad,)))
    with pytest.raises(ContractError, match="feeds 2 tokens for 0 proposals"):
        check_plan(StepPlan(1, (PlanRow("a", RowKind.DECODE, (1, 2), 0, (), None, True, GREEDY),)))
    # a row asking the engine's draft model for two proposals: draws after both, and the two named
    drafted = StepPlan(1, (PlanRow("a", RowKind.DECODE, (1,), 3, (), None, True, GREEDY, draft_k=2),))
    check_plan(drafted, {"a"})
    assert drafted.rows[0].end_pos == 6 and drafted.rows[0].with_proposals((4, 5)) == row
    check_result(drafted, StepResult(1, (RowOutput("a", token=4, verify=(Draw(5), Draw(6)), proposals=(4, 5)),)))
    check_result(drafted, StepResult(1, (RowOutput("a", token=4, verify=(Draw(5),), proposals=(4,)),)))  # fewer
    with pytest.raises(ContractError, match="got 3 draft proposals for 2 asked"):
        check_result(drafted, StepResult(1, (RowOutput("a", token=4, verify=(Draw(5),) * 3, proposals=(4, 5, 6)),)))
    with pytest.raises(ContractError, match="got 2 draws after proposals for 1"):
        check_result(drafted, StepResult(1, (RowOutput("a", token=4, verify=(Draw(5), Draw(6)), proposals=(4,)),)))
    with pytest.raises(ContractError, match="carries proposals and asks the engine for more"):
        check_plan(StepPlan(1, (replace(row, draft_k=1),)))


def test_the_ledger_rolls_back_after_a_verify_row_and_drops_blocks():
    ledger = PlanLedger(max_rows=1)
    first = PlanRow("a", RowKind.PREFILL, (1, 2, 3), 0, (7,), None, True, GREEDY, fresh=True)
    verify = PlanRow("a", RowKind.DECODE, (4, 5, 6, 7), 3, (8,), None, True, GREEDY, num_draft=3)
    for step, row in enumerate((first, verify)):
        plan = StepPlan(step, (row,))
        ledger.commit(plan, ledger.begin(plan)[1])
    rec = ledger.records["a"]
    assert (rec.block_table, rec.computed, rec.floor) == ([7, 8], 7, 4)
    with pytest.raises(ContractError, match=r"starts at 3; the engine has computed 7 \(verified from 4\)"):
        ledger.begin(StepPlan(2, (PlanRow("a", RowKind.DECODE, (9,), 3, (), None, True, GREEDY),)))
    # one proposal accepted: positions 3..4 stay, the next row starts at 5 and block 8 goes
    nxt = StepPlan(2, (PlanRow("a", RowKind.DECODE, (9,), 5, (9,), None, True, GREEDY, drop_blocks=1),))
    ledger.commit(nxt, ledger.begin(nxt)[1])
    assert (rec.block_table, rec.computed, rec.floor) == ([7, 9], 6, 6)
    with pytest.raises(ContractError, match="drops 3 blocks of 2"):
        ledger.begin(StepPlan(3, (PlanRow("a", RowKind.DECODE, (9,), 6, (), None, True, GREEDY,
                                          drop_blocks=3),)))


def test_rejected_positions_give_their_blocks_back_in_the_same_step():
    # error=1: every first proposal is wrong, so every verify row keeps one token
    sched, engine, _ = make_scheduler(vocab=50, block_size=2, num_blocks=20, max_verify_tokens_total=8,
                                      speculator=_oracle(k=4, error=1.0))
    req = make_request("a", 3, max_tokens=12)
    sched.add(req)
    sched.step()                                   # prefill: 3 tokens + 1 sampled = 2 blocks
    plan = sched.schedule()
    row = plan.rows[0]
    assert row.num_draft == 4 and len(req.blocks) == 4      # positions 3..7 need blocks 2 and 3
    result = engine.execute(plan)
    sched.apply(plan, result)
    assert len(req.output_token_ids) == 2 and len(req.blocks) == 3     # 5 tokens: 3 blocks
    assert sched.stats().blocks_used == 3
    nxt = sched.schedule()
    assert nxt.rows[0].drop_blocks == 1 and nxt.rows[0].start_pos == 4
    sched.apply(nxt, engine.execute(nxt))
    assert engine.tables[-1]["a"] == tuple(req.block_ids[:len(engine.tables[-1]["a"])])


def test_eos_and_max_tokens_inside_an_accepted_run_cut_it_exactly_there():
    plain, _, _ = _run([(5, 12)])
    out = plain[0][0]
    eos = out[4]
    sched, _, _ = make_scheduler(vocab=50, max_verify_tokens_total=16, speculator=_oracle(k=6, error=0.0))
    req = make_request("r0", 5, max_tokens=12, eos=(eos,), seed=0)
    sched.add(req)
    events = drain(sched)["r0"]
    assert req.output_token_ids == out[:out.index(eos) + 1] and req.finish_reason is FinishReason.STOP
    assert tokens(events) == req.output_token_ids and events[-1].finished is FinishReason.STOP
    assert [e.generated_tokens for e in events] == list(range(1, len(events) + 1))
    got, sched, _ = _run([(5, 7)], _oracle(k=6, error=0.0), max_verify_tokens_total=16)
    assert got == [(out[:7], FinishReason.LENGTH)] and sched.stats().spec_accepted_tokens_total > 0


def test_a_stop_string_above_the_scheduler_drops_the_rest_of_a_run():
    sched, _, _ = make_scheduler(vocab=50, max_verify_tokens_total=16, speculator=_oracle(k=4, error=0.0))
    req = make_request("a", 5, max_tokens=20)
    sched.add(req)
    while len(req.output_token_ids) < 6:
        events = sched.step()
    assert len(events) > 1                         # a run of several tokens came in one step
    sched.finish("a", FinishReason.STOP, tokens=events[0].generated_tokens)
    assert len(req.output_token_ids) == events[0].generated_tokens
    assert len(req.all_token_ids) == 5 + events[0].generated_tokens
    assert drain(sched)["a"][-1].generated_tokens == events[0].generated_tokens


class _BracketTokenizer:
    """Each id decodes to "<id>": stop strings name tokens exactly."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(f"<{i}>" for i in ids)


def _loop_run(stop: tuple[str, ...], speculator=None):
    """One request through an EngineLoop over a FakeEngine: its deltas and the tokens of each step."""
    sched, _, _ = make_scheduler(vocab=50, max_verify_tokens_total=16, speculator=speculator)
    steps, step = [], sched.step
    sched.step = lambda: steps.append(step()) or steps[-1]
    loop = EngineLoop(sched, _BracketTokenizer(), ())
    handle = loop.submit(list(range(1, 6)), SamplingParams(max_tokens=30, stop=stop), bounded=False)
    loop.run_until_idle()
    return list(handle), [tokens(evs) for evs in steps if tokens(evs)], handle.request


def test_a_stop_string_inside_an_accepted_run_ends_the_output_exactly_there():
    _, runs, _ = _loop_run((), _oracle(k=6, error=0.0))
    before = next(i for i, run in enumerate(runs) if len(run) >= 3)
    stop = _BracketTokenizer().decode(runs[before][:2])      # its first two tokens: the rest is cut
    want, _, plain = _loop_run((stop,))
    got, got_runs, req = _loop_run((stop,), _oracle(k=6, error=0.0))
    assert sum(len(r) for r in runs[:before]) + 2 == len(plain.output_token_ids)   # stops there
    assert got_runs[-1] == runs[before] and len(got_runs) == before + 1      # inside that run
    assert "".join(d.text for d in got) == "".join(d.text for d in want)
    assert req.output_token_ids == plain.output_token_ids == [t for d in got for t in d.token_ids]
    assert got[-1].completion_tokens == want[-1].completion_tokens == len(plain.output_token_ids)
    assert got[-1].finish_reason is FinishReason.STOP


def test_stats_count_proposed_and_accepted_tokens():
    _, sched, _ = _run([(5, 30), (9, 30)], _oracle(error=0.3), max_verify_tokens_total=16)
    st = sched.stats()
    assert 0 < st.spec_accepted_tokens_total < st.spec_proposed_tokens_total
    assert st.spec_acceptance_rate == st.spec_accepted_tokens_total / st.spec_proposed_tokens_total
    assert 1 < st.spec_mean_acceptance_length <= 5
    assert st.generation_tokens_total == 60


def test_the_console_monitor_shows_acceptance_once_anything_was_verified():
    from console.client import EngineSnapshot
    from console.widgets.monitor import cache_line

    assert cache_line(EngineSnapshot(cached_blocks=3)) == "prefix cache hit rate 0.0% · cached blocks 3"
    _, sched, _ = _run([(5, 30)], _oracle(error=0.3), max_verify_tokens_total=16)
    snap = EngineSnapshot.from_fields(sched.stats(), ())
    assert cache_line(snap).endswith(f" · speculation {snap.spec_acceptance_rate:.1%} accepted, "
                                     f"{snap.spec_mean_acceptance_length:.2f} tokens per verify row")
    assert snap.spec_proposed_tokens_total > 0


# ---- the rule keeps the target distribution ------------------------------------------------------
def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def test_random_verify_draws_keep_the_target_distribution():
    """A deliberately bad proposal (the least likely token): the first kept token is still
    distributed as p_target, the proposal is accepted with probability p_target(x), and an
    always-accept rule would fail the same test by far."""
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.5], [0.0, 1.0, 0.0, -1.0, 0.5]])
    probs = torch.softmax(logits, dim=-1)
    bad, n = 4, 6000
    first = torch.zeros(5)
    second = torch.zeros(5)             # the draw after an accepted proposal: p_target at position 1
    accepted = 0
    for seed in range(n):
        params = SamplingParams(temperature=1.0, seed=seed)
        row = _verify_row((bad,), params=params)
        (draw0, draw1), = sample(logits.clone(), [row])
        out = RowOutput("a", token=draw0[0], verify=(Draw(draw1[0]),))
        run = accepted_run(row, out)
        first[run[0].token] += 1
        if len(run) == 2:
            accepted += 1
            second[run[1].token] += 1
    critical = 18.47                    # chi-square, 4 degrees of freedom, p = 0.001
    assert _chi_square(first, probs[0]) < critical
    assert _chi_square(second, probs[1]) < critical
    rate, p_bad = accepted / n, float(probs[0, bad])
    assert abs(rate - p_bad) < 4 * (p_bad * (1 - p_bad) / n) ** 0.5
    always = torch.zeros(5)
    always[bad] = n
    assert _chi_square(always, probs[0]) > 100 * critical


def test_a_seeded_verify_row_draws_what_single_token_rows_would():
    logits = torch.randn(3, 7, generator=torch.Generator().manual_seed(1))
    params = SamplingParams(temperature=0.9, top_p=0.9, seed=42)
    row = _verify_row((2, 3), params=params, index=5)
    together = [d[0] for d in sample(logits.clone(), [row])[0]]
    alone = [sample(logits[i:i + 1].clone(), [PlanRow("a", RowKind.DECODE, (1,), 3, (), None, True, params,
                                                       sample_index=5 + i)])[0][0][0] for i in range(3)]
    assert together == alone
