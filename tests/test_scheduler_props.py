"""Random workloads against the scheduler: invariants after every step, clean drains, one final
event per request. Bounded so it runs in seconds."""
from __future__ import annotations

import pytest
from fake_engine import PER_REQUEST_OPS, act_on, check_invariants, drain, make_request, make_scheduler
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.contracts import check_plan
from engine.request import RequestState
from engine.scheduler import QueueFull, RequestRejected

CONFIGS = st.fixed_dictionaries({
    "block_size": st.sampled_from([1, 2, 2, 4, 16]),
    "num_blocks": st.integers(3, 16),
    "max_rows": st.integers(1, 5),
    "num_state_slots": st.sampled_from([0, 1, 2, 3]),
    "max_model_len": st.integers(6, 48),
    "max_prefill_rows": st.integers(1, 4),
    "max_prefill_tokens_per_row": st.integers(1, 16),
    "max_prefill_tokens_total": st.integers(1, 24),
    "mixed_prefill_tokens_total": st.none() | st.integers(1, 8),
    "prefill_quantum": st.integers(1, 8),
})
OPS = st.lists(st.tuples(st.sampled_from(["add", "add", "add", "step", "step", "step", "cancel", "pause",
                                          "resume", "fail_row", "step_error", "raise"]),
                         st.integers(0, 10**6)), min_size=5, max_size=80)


@pytest.mark.parametrize("overlap", [False, True])
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=CONFIGS, ops=OPS, max_waiting=st.none() | st.integers(1, 4))
def test_random_workloads_keep_the_invariants(overlap, cfg, ops, max_waiting):
    sched, engine, clock = make_scheduler(max_waiting=max_waiting, vocab=50, overlap=overlap, **cfg)
    execute = engine.execute

    def checked_execute(plan):
        # what the scheduler promised at the moment the engine runs the plan
        check_plan(plan, {r.id for r in sched._running if r.state is RequestState.DECODE})
        assert len(plan.rows) <= cfg["max_rows"]
        tables = [b for row in plan.rows for b in sched.get(row.request_id).block_ids]
        assert len(tables) == len(set(tables)), "two rows share a block"
        return execute(plan)

    engine.execute = checked_execute
    finals: dict[str, int] = {}
    added: list[str] = []

    def record(events):
        for ev in events:
            assert finals.get(ev.request_id, 0) == 0, f"event for {ev.request_id} after its final one"
            if ev.finished is not None:
                finals[ev.request_id] = 1

    for op, seed in ops:
        pick = added[seed % len(added)] if added else "none"
        if op == "add":
            n, rid = 1 + seed % (8 if seed % 4 else 40), f"r{len(added)}"
            req = make_request(rid, n, max_tokens=1 + seed % 24, eos=(seed % 50,),
                               min_tokens=seed % 3 if seed % 24 >= 2 else 0, seed=seed)
            try:
                sched.add(req)
                added.append(rid)
            except RequestRejected:
                need = -(-n // cfg["block_size"]) + 1
                assert n >= cfg["max_model_len"] or need > cfg["num_blocks"]
            except QueueFull:
                assert sched.stats().waiting == max_waiting
        elif op == "step":
            clock.now += 0.1
            record(sched.step())
        elif op in PER_REQUEST_OPS:
            act_on(sched, engine, op, pick)
        elif op == "step_error":
            engine.error_on_steps.add(sched._next_step)
        else:
            engine.raise_on_steps.add(sched._next_step)
        check_invariants(sched)
    for rid in added:
        sched.resume(rid)
    for evs in drain(sched).values():
        record(evs)
    assert set(finals) == set(added), "every request ends exactly once"


@pytest.mark.parametrize("overlap", [False, True])
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(block_size=st.sampled_from([1, 2, 4]), spare_blocks=st.integers(0, 6), max_rows=st.integers(2, 5),
       num_state_slots=st.sampled_from([0, 2, 5]),
       specs=st.lists(st.tuples(st.integers(1, 10), st.integers(1, 20)), min_size=2, max_size=6))
def test_tight_pools_preempt_without_changing_outputs(overlap, block_size, spare_blocks, max_rows,
                                                       num_state_slots, specs):
    num_blocks = max(-(-n // block_size) + 1 for n, _ in specs) + spare_blocks
    def run(**cfg):
        sched, _, _ = make_scheduler(block_size=block_size, vocab=50, **cfg)
        requests = [make_request(f"r{i}", n, max_tokens=mt, seed=i) for i, (n, mt) in enumerate(specs)]
        for req in requests:
            sched.add(req)
        drain(sched)
        return [(r.output_token_ids, r.finish_reason) for r in requests], sched.stats().preemptions_total

    tight, _ = run(num_blocks=num_blocks, max_rows=max_rows, num_state_slots=num_state_slots, overlap=overlap)
    roomy, preemptions = run(num_blocks=200, max_rows=1)
    assert preemptions == 0
    # the tight pool clamps max_tokens, so a tight output is a prefix of the roomy one
    for (got, reason), (want, _) in zip(tight, roomy):
        assert got == want[:len(got)] and reason is not None
