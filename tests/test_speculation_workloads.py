"""Speculative decoding without a model, random workloads: random acceptance lengths (proposals from
the scheduler's oracle or the engine's fake draft model), cancels, pauses, failed rows and preemption
keep the invariants and never change an output."""
from __future__ import annotations

import pytest
from fake_engine import act_on, check_invariants, drain, make_request, make_scheduler
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_speculation import _loud, _run, _speculating

from engine.contracts import check_plan
from engine.request import RequestState


# ---- random workloads ------------------------------------------------------------------------------
CONFIGS = st.fixed_dictionaries({
    "block_size": st.sampled_from([1, 2, 4]),
    "num_blocks": st.integers(4, 24),
    "max_rows": st.integers(1, 4),
    "max_model_len": st.integers(8, 48),
    "max_prefill_tokens_total": st.integers(1, 24),
    "prefill_quantum": st.integers(1, 8),
    "max_verify_tokens_total": st.integers(0, 12),
    "num_state_slots": st.sampled_from([0, 0, 2, 6]),      # hybrid: state rolls back, checkpoints
})
OPS = st.lists(st.tuples(st.sampled_from(["add", "add", "step", "step", "step", "step", "cancel",
                                          "pause", "resume", "fail_row"]),
                         st.integers(0, 10**6)), min_size=5, max_size=60)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=CONFIGS, ops=OPS, k=st.integers(1, 6), error=st.sampled_from([0.0, 0.2, 0.5, 1.0]),
       prefix_cache=st.booleans(), draft=st.booleans())
def test_random_workloads_with_random_acceptance_keep_the_invariants(cfg, ops, k, error, prefix_cache, draft):
    sched, engine, clock = make_scheduler(vocab=50, prefix_cache=prefix_cache, **_speculating(k, error, draft),
                                          **cfg)
    execute = engine.execute

    def checked_execute(plan):
        check_plan(plan, {r.id for r in sched._running if r.state is RequestState.DECODE})
        held = {row.request_id: tuple(sched.get(row.request_id).block_ids) for row in plan.rows}
        owned = [b for ids in held.values() for b in ids]
        cache = sched.kv.blocks.cache
        assert all(cache is not None and cache.is_cached(b) for b in set(owned) if owned.count(b) > 1), \
            "two rows share a block the prefix cache does not hold"
        result = execute(plan)
        # the engine's tables are exactly the blocks the requests hold: it never writes a freed one
        assert engine.tables[-1] == held
        return result

    engine.execute = _loud(checked_execute)
    added = []
    for op, seed in ops:
        pick = added[seed % len(added)] if added else "none"
        if op == "add":
            rid = f"r{len(added)}"
            try:
                # few distinct prompts, so that the prefix cache hits
                sched.add(make_request(rid, 1 + seed % 12, max_tokens=1 + seed % 30, eos=(seed % 50,),
                                       seed=seed % 3))
                added.append(rid)
            except ValueError:
                pass
        elif op == "step":
            clock.now += 0.1
            sched.step()
        else:
            act_on(sched, engine, op, pick)
        check_invariants(sched)
    for rid in added:
        sched.resume(rid)
    drain(sched)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(block_size=st.sampled_from([1, 2, 4]), spare_blocks=st.integers(0, 6), max_rows=st.integers(2, 4),
       k=st.integers(1, 6), error=st.sampled_from([0.0, 0.3, 1.0]),
       specs=st.lists(st.tuples(st.integers(1, 10), st.integers(1, 20)), min_size=2, max_size=5),
       draft=st.booleans(), slots=st.sampled_from([0, 6]))
def test_speculation_and_preemption_never_change_outputs(block_size, spare_blocks, max_rows, k, error, specs,
                                                         draft, slots):
    num_blocks = max(-(-n // block_size) + 1 for n, _ in specs) + spare_blocks
    tight, sched, _ = _run(specs, block_size=block_size, num_blocks=num_blocks, max_rows=max_rows,
                           max_verify_tokens_total=12, num_state_slots=slots, **_speculating(k, error, draft))
    roomy, _, _ = _run(specs, block_size=block_size, num_blocks=200, max_rows=1)
    for (got, reason), (want, _) in zip(tight, roomy):     # a tight pool clamps max_tokens
        assert got == want[:len(got)] and reason is not None


@pytest.mark.parametrize("draft", [False, True])
def test_preempted_speculating_requests_give_the_same_outputs(draft):
    specs = [(6, 20), (5, 20), (7, 20)]
    got, sched, _ = _run(specs, block_size=2, num_blocks=14, max_rows=3, max_verify_tokens_total=12,
                         **_speculating(4, 0.3, draft))
    st = sched.stats()
    assert st.preemptions_total > 0 and 0 < st.spec_accepted_tokens_total < st.spec_proposed_tokens_total
    assert got == _run(specs, block_size=2, num_blocks=200, max_rows=1)[0]
