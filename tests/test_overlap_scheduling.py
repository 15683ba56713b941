"""Overlapped scheduling against the synchronous scheduler on the fake engine: the same plans (PENDING
where a token was not known yet), the same outputs, failures contained, fallbacks where a step's draws
decide the next plan."""
from __future__ import annotations

import pytest
from fake_engine import OracleProposer, drain, make_request, make_scheduler, tokens
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.contracts import PENDING, ContractError, PlanRow, RowKind, StepPlan, check_plan
from engine.request import FinishReason
from engine.speculation import Speculator

SPECS = st.lists(st.tuples(st.integers(1, 12), st.integers(1, 12), st.integers(0, 6)), min_size=1, max_size=6)
ENGINE = dict(block_size=2, num_blocks=24, max_rows=3, vocab=40, max_prefill_tokens_total=8,
              max_prefill_tokens_per_row=8, prefill_quantum=2, mixed_prefill_tokens_total=4)


def run(specs, overlap: bool, eos: bool, **engine_kw):
    """Requests (prompt length, max_tokens, the step() call before which each arrives), stepped
    until drained; the plans the engine ran and each request's events."""
    sched, engine, _ = make_scheduler(overlap=overlap, prefix_cache=True, **{**ENGINE, **engine_kw})
    arrivals = sorted((at, i) for i, (_, _, at) in enumerate(specs))
    events: dict[str, list] = {}
    call = 0
    while arrivals or sched.has_work:
        while arrivals and arrivals[0][0] <= call:
            i = arrivals.pop(0)[1]
            n, max_tokens, _ = specs[i]
            sched.add(make_request(f"r{i}", n, max_tokens=max_tokens, seed=i % 2, eos=(7,) if eos else ()))
        for ev in sched.step():
            events.setdefault(ev.request_id, []).append(ev)
        call += 1
    st_ = sched.stats()
    assert (st_.blocks_used, st_.blocks_reserved) == (0, 0)
    return engine.plans, events


def summary(events):
    return {rid: (tokens(evs), evs[-1].finished, [e.generated_tokens for e in evs]) for rid, evs in events.items()}


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(specs=SPECS, tight=st.booleans())
def test_without_stop_ids_the_plans_are_the_synchronous_ones_with_pending_tokens(specs, tight):
    kw = dict(num_blocks=9) if tight else {}    # preemptions too
    sync_plans, sync_events = run(specs, overlap=False, eos=False, **kw)
    plans, events = run(specs, overlap=True, eos=False, **kw)
    assert summary(events) == summary(sync_events)
    assert len(plans) == len(sync_plans)
    pending = 0
    for plan, want in zip(plans, sync_plans):
        assert [r.request_id for r in plan.rows] == [r.request_id for r in want.rows]
        for row, ref in zip(plan.rows, want.rows):
            if row.token_ids[-1] == PENDING:
                pending += 1
                row = PlanRow(**{**row.__dict__, "token_ids": ref.token_ids})
            assert row == ref
    if not tight and any(max_tokens > 1 for _, max_tokens, _ in specs):
        assert pending, "no plan was made ahead of its predecessor's tokens"


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(specs=SPECS)
def test_stop_ids_give_the_same_outputs(specs):
    _, sync_events = run(specs, overlap=False, eos=True)
    _, events = run(specs, overlap=True, eos=True)
    assert summary(events) == summary(sync_events)


def test_a_stop_id_leaves_one_dead_row_whose_output_is_dropped():
    def go(overlap):
        sched, engine, _ = make_scheduler(overlap=overlap, **ENGINE)
        engine.forced[("a", 2)] = 7
        sched.add(make_request("a", 3, max_tokens=10, eos=(7,)))
        sched.add(make_request("b", 3, max_tokens=6, seed=1, eos=(7,)))
        return engine, drain(sched)

    sync_engine, sync_events = go(False)
    engine, events = go(True)
    assert summary(events) == summary(sync_events)
    assert tokens(events["a"])[-1] == 7 and events["a"][-1].finished is FinishReason.STOP
    rows_of_a = [sum(r.request_id == "a" for r in p.rows) for p in engine.plans]
    assert sum(rows_of_a) == sum(sum(r.request_id == "a" for r in p.rows) for p in sync_engine.plans) + 1
    # the dead row fed a's stop id (resolved by the engine) and is forgotten in the plan after
    dead = max(i for i, n in enumerate(rows_of_a) if n)
    assert engine.plans[dead].rows[0].token_ids == (PENDING,) and "a" in engine.plans[dead + 1].forget


@pytest.mark.parametrize("failure", ["row", "step_error", "raise"])
def test_a_failed_step_fails_its_requests_and_serving_goes_on(failure):
    sched, engine, _ = make_scheduler(overlap=True, **ENGINE)
    sched.add(make_request("a", 3, max_tokens=8))
    sched.add(make_request("b", 3, max_tokens=8, seed=1))
    for _ in range(3):
        sched.step()
    if failure == "row":
        engine.fail_rows.add("a")
    else:
        (engine.error_on_steps if failure == "step_error" else engine.raise_on_steps).add(sched._next_step)
    events = drain(sched)
    failed = {"a"} if failure == "row" else {"a", "b"}
    for rid in ("a", "b"):
        assert (events[rid][-1].finished is FinishReason.ERROR) == (rid in failed)
        assert sum(e.finished is not None for e in events[rid]) == 1
    sched.add(make_request("c", 2, max_tokens=4, seed=2))
    events = drain(sched)["c"]
    assert events[-1].finished is FinishReason.LENGTH and len(tokens(events)) == 4


def test_cancel_while_a_step_is_in_flight_ends_the_request_once():
    sched, engine, _ = make_scheduler(overlap=True, **ENGINE)
    sched.add(make_request("a", 3, max_tokens=20))
    got = []
    for _ in range(4):
        got += sched.step()
    sched.cancel("a")
    events = drain(sched)["a"]
    assert [e.finished for e in events] == [FinishReason.CANCELLED]
    assert all(e.finished is None for e in got)


class _AllowAll:
    """A grammar matcher that allows every token: its requests' plans must be read before the next."""
    done, error = False, None

    def mask(self):
        return None

    def accept(self, token: int) -> bool:
        return True


def test_a_grammar_row_is_read_before_the_next_plan():
    def go(overlap):
        sched, engine, _ = make_scheduler(overlap=overlap, **ENGINE)
        req = make_request("g", 3, max_tokens=5)
        req.matcher = _AllowAll()
        sched.add(req)
        sched.add(make_request("p", 3, max_tokens=10, seed=1))
        return engine.plans, drain(sched)

    _, sync_events = go(False)
    plans, events = go(True)
    assert summary(events) == summary(sync_events)
    pending = {r.request_id for p in plans for r in p.rows if r.token_ids[-1] == PENDING}
    assert pending == {"p"}


def test_speculation_is_refused_with_overlap():
    with pytest.raises(ValueError, match="turn one of them off"):
        make_scheduler(overlap=True, speculator=Speculator(OracleProposer(40), 3), max_verify_tokens_total=8)


def test_pending_only_as_a_sampling_rows_last_token():
    row = PlanRow("a", RowKind.PREFILL, (1, PENDING), 0, (0,), None, False)
    with pytest.raises(ContractError, match="PENDING"):
        check_plan(StepPlan(0, (row,)))
