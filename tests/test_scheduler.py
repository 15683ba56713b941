"""Scheduler behaviours 1-8 (DESIGN.md) against the scripted FakeEngine; no model."""
from __future__ import annotations

import dataclasses

import pytest
from fake_engine import (FakeEngine, check_invariants, drain, drop_last_row, make_request,
                         make_scheduler, tokens)

from engine.contracts import ContractError, RowKind
from engine.request import FinishReason, RequestState
from engine.scheduler import QueueFull, RequestRejected


def plan_ids(engine: FakeEngine) -> list[set[str]]:
    return [{r.request_id for r in p.rows} for p in engine.plans]


def first_step_of(engine: FakeEngine, rid: str) -> int:
    return next(i for i, ids in enumerate(plan_ids(engine)) if rid in ids)


def merge(into: dict, events) -> dict:
    for ev in events:
        into.setdefault(ev.request_id, []).append(ev)
    return into


def reference(specs, **engine_kw) -> dict[str, list[int]]:
    """Each request run alone on a roomy engine: the outputs any schedule must reproduce."""
    out = {}
    for rid, n, max_tokens in specs:
        sched, _, _ = make_scheduler(**engine_kw)
        sched.add(make_request(rid, n, max_tokens))
        out[rid] = tokens(drain(sched)[rid])
    return out


# ---- 1. admission ---------------------------------------------------------------------------------
def test_fifo_head_of_line_blocks_later_requests():
    # A reserves 4 of 10 blocks; B needs 7 (24 tokens / 4 + 1) and must wait; C (1 block + 1) fits
    # but may not overtake B
    sched, engine, _ = make_scheduler(block_size=4, num_blocks=10)
    for req in (make_request("A", 12, max_tokens=4), make_request("B", 24, max_tokens=2),
                make_request("C", 2, max_tokens=2)):
        sched.add(req)
    events = drain(sched)
    a_last, b_first, c_first = (max(i for i, s in enumerate(plan_ids(engine)) if "A" in s),
                                first_step_of(engine, "B"), first_step_of(engine, "C"))
    assert b_first == a_last + 1, "B is admitted in the step right after A retires"
    assert c_first >= b_first, "C overtook the waiting head B"
    assert all(events[r][-1].finished is FinishReason.LENGTH for r in "ABC")


def test_admission_waits_for_a_free_row_and_a_state_slot():
    sched, engine, _ = make_scheduler(max_rows=4, num_state_slots=2)
    for i in range(3):
        sched.add(make_request(f"r{i}", 5, max_tokens=3))
    drain(sched)
    assert first_step_of(engine, "r2") == 3, "r2 waits for a slot until r0/r1 finish (3 steps)"
    assert engine.resets == [0, 1, 0], "a slot is reset each time it is handed out"
    sched, engine, _ = make_scheduler(max_rows=1)
    sched.add(make_request("x", 5, max_tokens=2))
    sched.add(make_request("y", 5, max_tokens=2))
    drain(sched)
    assert plan_ids(engine) == [{"x"}, {"x"}, {"y"}, {"y"}]


# ---- 2. rejection and clamping ----------------------------------------------------------------------
def test_too_long_prompt_fails_at_once_with_both_numbers():
    sched, _, _ = make_scheduler(max_model_len=4096, num_blocks=2000, block_size=4)
    with pytest.raises(RequestRejected, match="prompt has 5,000 tokens; max_model_len is 4,096"):
        sched.add(make_request("long", 5000))
    sched, _, _ = make_scheduler(num_blocks=8, block_size=4)
    with pytest.raises(RequestRejected, match="prompt has 40 tokens and needs 11 K/V blocks .* 8 blocks"):
        sched.add(make_request("big", 40))
    with pytest.raises(RequestRejected, match="empty"):
        sched.add(make_request("empty", 0))
    sched.add(make_request("dup", 3))
    with pytest.raises(RequestRejected, match="already live"):
        sched.add(make_request("dup", 3))
    assert sched.stats().waiting == 1


def test_queue_full_is_typed():
    sched, _, _ = make_scheduler(max_waiting=2)
    sched.add(make_request("a", 3))
    sched.add(make_request("b", 3))
    with pytest.raises(QueueFull, match="max_waiting=2"):
        sched.add(make_request("c", 3))


def test_max_tokens_clamped_to_context_and_pool():
    sched, _, _ = make_scheduler(max_model_len=16)
    req = make_request("a", 10, max_tokens=100)
    sched.add(req)
    assert req.max_tokens == 6 and req.params.max_tokens == 100
    events = drain(sched)["a"]
    assert len(tokens(events)) == 6 and events[-1].finished is FinishReason.LENGTH
    assert len(req.all_token_ids) == 16
    # a pool of 4 blocks of 4 tokens: the last generated token is never fed, one spare block kept
    sched, _, _ = make_scheduler(num_blocks=4, block_size=4)
    req = make_request("b", 5, max_tokens=100)
    sched.add(req)
    assert req.max_tokens == 3 * 4 - 5 + 1


# ---- 3. fair prefill --------------------------------------------------------------------------------
def test_short_prompt_is_not_stuck_behind_a_long_one():
    # one quantum per step: the long prompt alone would need 63 steps of prefill
    sched, engine, _ = make_scheduler(prefill_quantum=16, max_prefill_tokens_total=16,
                                      max_prefill_tokens_per_row=64, num_blocks=300)
    sched.add(make_request("long", 1000, max_tokens=1))
    sched.step()
    sched.add(make_request("short", 8, max_tokens=1))
    events = {}
    for _ in range(3):
        for ev in sched.step():
            events[ev.request_id] = ev
    assert events["short"].finished is FinishReason.LENGTH, "short finished within 3 steps"
    assert "long" not in events and sched.get("long").state is RequestState.PREFILL
    drain(sched)


def test_prefill_grants_respect_every_limit_and_rotate():
    sched, engine, _ = make_scheduler(max_rows=6, max_prefill_rows=3, prefill_quantum=4,
                                      max_prefill_tokens_per_row=8, max_prefill_tokens_total=20,
                                      num_blocks=200)
    for i in range(5):
        sched.add(make_request(f"p{i}", 40, max_tokens=2, seed=i))
    drain(sched)
    served = []
    for plan in engine.plans:
        chunks = [len(r.token_ids) for r in plan.rows if r.kind is RowKind.PREFILL]
        assert len(chunks) <= 3 and max(chunks, default=0) <= 8 and sum(chunks) <= 20
        assert len(plan.rows) <= 6
        served.append({r.request_id for r in plan.rows if r.kind is RowKind.PREFILL})
    # 5 prefillers, 3 rows a step: nobody waits more than one step for its next chunk
    for i in range(5):
        steps = [k for k, s in enumerate(served) if f"p{i}" in s]
        assert steps[0] <= 1 and all(b - a <= 2 for a, b in zip(steps, steps[1:]))


def test_decoder_emits_every_step_while_a_long_prompt_prefills():
    sched, engine, _ = make_scheduler(prefill_quantum=32, max_prefill_tokens_total=64,
                                      mixed_prefill_tokens_total=32, num_blocks=300)
    sched.add(make_request("dec", 4, max_tokens=60))
    sched.step()                                   # dec's prompt in one chunk, first token
    sched.add(make_request("long", 1000, max_tokens=1))
    steps = 0
    while sched.get("long") is not None:
        got = [e for e in sched.step() if e.request_id == "dec" and e.token is not None]
        assert len(got) == 1, "the decoder got a token in this step"
        steps += 1
    assert steps == 1000 // 32 + 1
    assert all(sum(len(r.token_ids) for r in p.rows if r.kind is RowKind.PREFILL) <= 32
               for p in engine.plans[1:]), "mixed steps get the smaller prefill capacity"
    drain(sched)


# ---- 4. mixed plans ----------------------------------------------------------------------------------
def test_decode_rows_and_prefill_chunks_share_a_plan():
    sched, engine, _ = make_scheduler(prefill_quantum=4, max_prefill_tokens_total=4)
    sched.add(make_request("a", 3, max_tokens=5))
    sched.step()
    sched.add(make_request("b", 10, max_tokens=2))
    drain(sched)
    plan = engine.plans[1]
    kinds = {r.request_id: r for r in plan.rows}
    assert kinds["a"].kind is RowKind.DECODE and kinds["a"].sample
    assert kinds["b"].kind is RowKind.PREFILL and kinds["b"].token_ids == make_request("b", 10).prompt_token_ids[:4]
    b_rows = [r for p in engine.plans for r in p.rows if r.request_id == "b"]
    assert [(r.kind, r.start_pos, len(r.token_ids), r.sample) for r in b_rows] == [
        (RowKind.PREFILL, 0, 4, False), (RowKind.PREFILL, 4, 4, False), (RowKind.PREFILL, 8, 2, True),
        (RowKind.DECODE, 10, 1, True)]
    b_tables = [t["b"] for t in engine.tables if "b" in t]
    assert all(len(t) * 4 >= r.end_pos for t, r in zip(b_tables, b_rows))


# ---- 5. preemption -----------------------------------------------------------------------------------
def test_preemption_keeps_outputs_identical():
    specs = [(f"r{i}", 5 + 3 * i, 12) for i in range(4)]
    expected = reference(specs, num_blocks=100, block_size=2)
    sched, engine, _ = make_scheduler(num_blocks=14, block_size=2, max_rows=4)
    reqs = [make_request(rid, n, mt) for rid, n, mt in specs]
    for req in reqs:
        sched.add(req)
    events = drain(sched)
    assert sched.stats().preemptions_total > 0 and sum(r.preemptions for r in reqs) > 0
    assert {rid: tokens(ev) for rid, ev in events.items()} == expected
    assert all(len(ev) == 12 and ev[-1].finished is FinishReason.LENGTH for ev in events.values())


def test_needy_newest_decoder_preempts_itself_and_resumes_at_the_head():
    # 6 blocks of 2: A (3 tokens) and B (4 tokens) reserve 3 each; in step 3 B (the newest) needs
    # a 4th block for position 6 while A still fits in its 3
    sched, engine, _ = make_scheduler(num_blocks=6, block_size=2)
    a, b = make_request("A", 3, max_tokens=6), make_request("B", 4, max_tokens=6)
    sched.add(a), sched.add(b)
    events: dict = {}
    for _ in range(4):
        merge(events, sched.step())
    plan = engine.plans[-1]
    assert sched.get("B").state is RequestState.WAITING and b.preemptions == 1 and a.preemptions == 0
    assert [r.request_id for r in plan.rows] == ["A"] and len(b.output_token_ids) == 3
    sched.add(make_request("C", 1, max_tokens=1))
    merge(events, [e for evs in drain(sched).values() for e in evs])
    back = next(k for k in range(4, len(engine.plans)) if "B" in plan_ids(engine)[k])
    assert first_step_of(engine, "C") >= back, "C did not overtake the preempted B"
    recomputed = next(r for r in engine.plans[back].rows if r.request_id == "B")
    assert recomputed.start_pos == 0 and recomputed.token_ids[4:] == tuple(b.output_token_ids[:3])
    assert tokens(events["A"]) + tokens(events["B"]) == sum(reference(
        [("A", 3, 6), ("B", 4, 6)], num_blocks=50, block_size=2).values(), [])


# ---- 6. finishing -------------------------------------------------------------------------------------
def test_eos_and_stop_ids_finish_in_the_same_step_and_free_everything():
    sched, engine, _ = make_scheduler(forced={("e", 2): 7, ("s", 1): 9, ("i", 1): 7}, num_state_slots=3)
    sched.add(make_request("e", 4, max_tokens=10, eos=(7,)))
    sched.add(make_request("s", 4, max_tokens=10, eos=(7,), stop_token_ids=(9,)))
    sched.add(make_request("i", 4, max_tokens=4, eos=(7,), ignore_eos=True))
    events = drain(sched)
    assert tokens(events["e"])[-1] == 7 and len(tokens(events["e"])) == 3
    assert events["e"][-1].finished is FinishReason.STOP and events["s"][-1].finished is FinishReason.STOP
    assert len(tokens(events["s"])) == 2 and events["i"][-1].finished is FinishReason.LENGTH
    assert len(tokens(events["i"])) == 4 and tokens(events["i"])[1] == 7
    assert sum(len(ev) for ev in events.values()) == 3 + 2 + 4, "one event per token, final included"


def test_retirement_frees_blocks_and_slot_in_the_finishing_step():
    sched, _, _ = make_scheduler(num_state_slots=1, forced={("a", 1): 7})
    sched.add(make_request("a", 6, max_tokens=10, eos=(7,)))
    sched.step()
    assert sched.stats().slots_used == 1 and sched.stats().blocks_used == 2
    assert [e.finished for e in sched.step()] == [FinishReason.STOP]
    st = sched.stats()
    assert (st.blocks_used, st.blocks_reserved, st.slots_used) == (0, 0, 0)


@pytest.mark.parametrize("honor_bans", [True, False])
def test_min_tokens_bans_eos_until_reached(honor_bans):
    forced = {("m", i): 7 for i in range(6)}
    sched, engine, _ = make_scheduler(forced=forced, honor_bans=honor_bans)
    sched.add(make_request("m", 4, max_tokens=10, eos=(7,), min_tokens=3, stop_token_ids=(8,)))
    events = drain(sched)["m"]
    bans = [r.banned_token_ids for p in engine.plans for r in p.rows if r.sample]
    assert bans[:3] == [(7, 8)] * 3 and bans[3] == ()
    assert len(tokens(events)) == 4 and events[-1].finished is FinishReason.STOP
    assert (7 in tokens(events)[:3]) is not honor_bans


# ---- 7. pause, resume, cancel -------------------------------------------------------------------------
def test_paused_decoder_leaves_the_plan_and_keeps_its_blocks():
    expected = reference([("a", 5, 6), ("b", 5, 6)])
    sched, engine, _ = make_scheduler()
    sched.add(make_request("a", 5, max_tokens=6))
    sched.add(make_request("b", 5, max_tokens=6))
    events = merge({}, sched.step())
    blocks = sched.get("a").block_ids
    assert sched.pause("a")
    for _ in range(3):
        merge(events, sched.step())
    assert all("a" not in ids for ids in plan_ids(engine)[1:])
    assert sched.get("a").block_ids == blocks and sched.stats().paused == 1
    assert sched.resume("a")
    merge(events, [e for evs in drain(sched).values() for e in evs])
    assert {k: tokens(v) for k, v in events.items()} == expected


def test_cancel_during_prefill_and_decode_frees_at_once():
    sched, engine, _ = make_scheduler(num_state_slots=2, prefill_quantum=16, max_prefill_tokens_total=16,
                                      num_blocks=300)
    sched.add(make_request("long", 1000))
    sched.add(make_request("dec", 2, max_tokens=50))
    sched.step(), sched.step()
    assert sched.get("dec").state is RequestState.DECODE
    assert sched.cancel("long") and sched.cancel("dec") and not sched.cancel("dec")
    st = sched.stats()
    assert (st.blocks_used, st.blocks_reserved, st.slots_used, st.running) == (0, 0, 0, 0)
    final = sched.step()
    assert {(e.request_id, e.finished) for e in final} == {("long", FinishReason.CANCELLED),
                                                           ("dec", FinishReason.CANCELLED)}
    assert not sched.has_work and len(engine.plans) == 2


def test_cancelled_waiting_request_never_runs():
    sched, engine, _ = make_scheduler(max_rows=1)
    sched.add(make_request("a", 3, max_tokens=3))
    sched.add(make_request("w", 3, max_tokens=3))
    sched.step()
    assert sched.cancel("w")
    events = drain(sched)
    assert [e.finished for e in events["w"]] == [FinishReason.CANCELLED]
    assert all("w" not in ids for ids in plan_ids(engine))


def test_finish_retires_for_a_stop_string():
    sched, _, _ = make_scheduler()
    sched.add(make_request("a", 3, max_tokens=30))
    sched.step()
    assert sched.finish("a")
    assert sched.stats().blocks_used == 0
    assert [e.finished for e in sched.step()] == [FinishReason.STOP]


# ---- 8. failures ---------------------------------------------------------------------------------------
def test_row_error_fails_only_its_request():
    expected = reference([("ok", 4, 5)])
    sched, engine, _ = make_scheduler()
    sched.add(make_request("ok", 4, max_tokens=5))
    sched.add(make_request("bad", 4, max_tokens=5))
    first = {e.request_id: e.token for e in sched.step()}
    engine.fail_rows.add("bad")
    events = drain(sched)
    assert [e.token for e in events["bad"]] == [None]
    assert events["bad"][-1].finished is FinishReason.ERROR and "injected row error" in events["bad"][-1].error
    assert [first["ok"]] + tokens(events["ok"]) == expected["ok"]


@pytest.mark.parametrize("how", ["raise", "error", "tamper"])
def test_step_failure_fails_the_plan_and_serving_continues(how):
    sched, engine, _ = make_scheduler()
    sched.add(make_request("a", 4, max_tokens=5))
    sched.add(make_request("b", 4, max_tokens=5))
    sched.step()
    if how == "raise":
        engine.raise_on_steps.add(1)
    elif how == "error":
        engine.error_on_steps.add(1)
    else:
        engine.tamper = drop_last_row
    events = sched.step()
    engine.tamper = None
    assert {e.request_id for e in events} == {"a", "b"}
    assert all(e.finished is FinishReason.ERROR for e in events)
    text = {"raise": "RuntimeError: injected failure in step 1", "error": "injected step error 1",
            "tamper": "broke the step contract"}[how]
    assert all(text in e.error for e in events)
    st = sched.stats()
    assert (st.blocks_used, st.blocks_reserved, st.running) == (0, 0, 0)
    sched.add(make_request("c", 4, max_tokens=3))
    assert drain(sched)["c"][-1].finished is FinishReason.LENGTH


def test_stale_duplicate_and_misnumbered_results_are_rejected():
    sched, engine, _ = make_scheduler()
    sched.add(make_request("a", 4, max_tokens=5))
    plan = sched.schedule()
    with pytest.raises(ContractError, match="outstanding"):
        sched.schedule()
    result = engine.execute(plan)
    with pytest.raises(ContractError, match="result for step 9"):
        sched.apply(plan, dataclasses.replace(result, step=9))
    assert sched.get("a").num_computed_tokens == 0
    assert len(sched.apply(plan, result)) == 1
    with pytest.raises(ContractError, match="not the outstanding plan"):
        sched.apply(plan, result)
    assert len(sched.get("a").output_token_ids) == 1
    plan2 = sched.schedule()
    with pytest.raises(ContractError, match="not the outstanding plan"):
        sched.apply(plan, result)
    sched.apply(plan2, engine.execute(plan2))
    check_invariants(sched)
    assert len(sched.get("a").output_token_ids) == 2


# ---- stats ----------------------------------------------------------------------------------------------
def test_stats_rates_and_latencies_from_the_injected_clock():
    sched, _, clock = make_scheduler(prefill_quantum=4, max_prefill_tokens_total=4)
    sched.add(make_request("a", 8, max_tokens=5))
    for _ in range(4):                          # prefill 4+4 (token at t=2), then decode at 3, 4
        clock.now += 1.0
        sched.step()
    st = sched.stats()
    assert (st.prompt_tokens_total, st.generation_tokens_total) == (8, 3)
    assert st.ttft_p50_s == 2.0 and st.itl_p50_s == 1.0
    assert st.prompt_tokens_per_s == pytest.approx(8 / 4) and st.generation_tokens_per_s == pytest.approx(3 / 4)
    assert st.requests[0].id == "a" and st.requests[0].generated_tokens == 3 and st.requests[0].age_s == 4.0
    clock.now += 3.0                            # two more tokens 3 s apart; window (5 s) keeps t>=3
    sched.step()
    clock.now += 0.0
    sched.step()
    st = sched.stats()
    # the window is t in [2, 7]: prompt 4 (t=2), tokens at t=2, 3, 4, 7, 7
    assert st.generation_tokens_total == 5 and st.generation_tokens_per_s == pytest.approx(5 / 5)
    assert st.prompt_tokens_per_s == pytest.approx(4 / 5)
    assert st.itl_p99_s == 3.0 and st.itl_p50_s == 1.0
    clock.now = 20.0                            # outside the 5 s window: rates fall to zero
    st = sched.stats()
    assert (st.prompt_tokens_per_s, st.generation_tokens_per_s, st.running) == (0.0, 0.0, 0)
