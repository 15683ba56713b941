"""Prefix caching against the scripted FakeEngine: hits, full-prompt hits, LRU eviction, hybrid
checkpoints, and random workloads whose outputs must match cache-off runs. No model."""
from __future__ import annotations

from fake_engine import check_invariants, drain, make_request, make_scheduler, prompt, tokens
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.kv.allocator import BlockAllocator
from engine.kv.prefix_cache import PrefixCache
from engine.request import FinishReason, Request, SamplingParams


def run_alone(rid: str, ids: tuple[int, ...], max_tokens: int, **engine_kw) -> list[int]:
    """The reference: one request on a roomy engine without the cache."""
    sched, _, _ = make_scheduler(num_blocks=200, **engine_kw)
    sched.add(Request(rid, ids, SamplingParams(max_tokens=max_tokens)))
    return tokens(drain(sched)[rid])


def first_row(engine, rid: str):
    return next(r for p in engine.plans for r in p.rows if r.request_id == rid)


# ---- attention K/V ----------------------------------------------------------------------------------
def test_a_follow_up_starts_after_the_cached_blocks_of_the_first_turn():
    sched, engine, _ = make_scheduler(prefix_cache=True, block_size=4)
    a = make_request("a", 10, max_tokens=5)
    sched.add(a)
    drain(sched)
    a_table = [t["a"] for t in engine.tables if "a" in t][-1]     # its table at its last step
    # turn 2: prompt + reply + 3 new tokens = 18 tokens; the first 14 are computed K/V (the last
    # reply token was never fed), so 3 full blocks (12 tokens) are cached
    follow = Request("b", tuple(a.all_token_ids) + (5, 6, 7), SamplingParams(max_tokens=4))
    sched.add(follow)
    events = drain(sched)
    row = first_row(engine, "b")
    assert row.start_pos == 12 and row.fresh and row.new_blocks[:3] == a_table[:3]
    assert tokens(events["b"]) == run_alone("b", follow.prompt_token_ids, 4, block_size=4)
    st_ = sched.stats()
    assert (st_.prefix_cache_query_tokens, st_.prefix_cache_hit_tokens) == (10 + 18, 12)
    assert st_.prefix_cache_hit_rate == 12 / 28 and st_.blocks_used == 0
    assert (a.num_cached_tokens, follow.num_cached_tokens) == (0, 12)


def test_a_preempted_request_counts_only_what_its_first_admission_found_cached():
    # test_scheduler's needy-newest case with the cache on: B is preempted after 3 tokens and comes
    # back to its own cached blocks, prompt and reply; none of that was cached for its prompt
    sched, engine, _ = make_scheduler(prefix_cache=True, num_blocks=6, block_size=2)
    a, b = make_request("A", 3, max_tokens=6), make_request("B", 4, max_tokens=6)
    sched.add(a), sched.add(b)
    drain(sched)
    starts = [r.start_pos for p in engine.plans for r in p.rows if r.request_id == "B" and r.kind.value == "prefill"]
    assert b.preemptions == 1 and starts[0] == 0 and starts[-1] > len(b.prompt_token_ids)
    assert (a.num_cached_tokens, b.num_cached_tokens) == (0, 0)


def test_a_fully_cached_prompt_recomputes_its_last_block_to_sample():
    sched, engine, _ = make_scheduler(prefix_cache=True, block_size=4)
    sched.add(make_request("x", 8, max_tokens=3))
    first = tokens(drain(sched)["x"])
    sched.add(make_request("x", 8, max_tokens=3))     # same id and prompt: same fake outputs
    again = drain(sched)["x"]
    rows = [r for p in engine.plans for r in p.rows if r.request_id == "x" and r.kind.value == "prefill"]
    assert [(r.start_pos, r.end_pos) for r in rows] == [(0, 8), (4, 8)]
    assert tokens(again) == first and again[-1].finished is FinishReason.LENGTH


def test_two_requests_share_blocks_and_reference_counts_follow():
    sched, engine, _ = make_scheduler(prefix_cache=True, block_size=4, max_rows=2)
    sched.add(make_request("a", 9, max_tokens=1))
    drain(sched)
    sched.add(make_request("b", 9, max_tokens=6))
    sched.add(make_request("c", 10, max_tokens=6))
    sched.step()
    shared = first_row(engine, "b").new_blocks[:2]
    assert first_row(engine, "c").new_blocks[:2] == shared
    assert [sched.kv.blocks.refcount(b) for b in shared] == [2, 2]
    drain(sched)
    assert [sched.kv.blocks.refcount(b) for b in shared] == [0, 0]
    assert sched.stats().cached_blocks >= 2 and sched.stats().blocks_used == 0


def test_idle_cached_blocks_are_evicted_least_recently_used_first():
    cache = PrefixCache(block_size=2)
    alloc = BlockAllocator(4, cache)
    chains = {}
    for name, ids in {"p": (1, 2), "q": (3, 4), "r": (5, 6)}.items():
        [h] = alloc.allocate(1)
        chains[name] = cache.chain()
        chains[name].extend(ids)
        assert cache.insert(h.block_id, chains[name], 0, ids)
        alloc.free([h])
    assert (alloc.num_free, alloc.num_used, cache.num_idle) == (4, 0, 3)
    alloc.free([alloc.share(cache.lookup((1, 2), chains["p"].hashes)[0])])   # p is used again
    got = alloc.allocate(3)     # the uncached block first, then q (least recent), then r
    assert [h.block_id for h in got] == [3, 1, 2] and cache.evictions == 2
    assert cache.lookup((3, 4), chains["q"].hashes) == [] and cache.lookup((1, 2), chains["p"].hashes) == [0]


def test_a_hash_collision_is_caught_by_the_token_check():
    cache = PrefixCache(block_size=2)
    alloc = BlockAllocator(2, cache)
    chain = cache.chain()
    chain.extend((1, 2))
    [h] = alloc.allocate(1)
    cache.insert(h.block_id, chain, 0, (1, 2))
    assert cache.lookup((1, 2), chain.hashes) == [h.block_id]
    assert cache.lookup((9, 9), chain.hashes) == []    # same hash presented with other tokens


# ---- hybrid state checkpoints -------------------------------------------------------------------------
HYBRID = dict(prefix_cache=True, block_size=4, num_state_slots=3, max_rows=1)


def test_hybrid_prefill_stops_at_the_due_boundary_and_a_follow_up_resumes_there():
    sched, engine, _ = make_scheduler(**HYBRID)
    a = make_request("a", 10, max_tokens=3)     # 13 tokens; decode computes up to position 12
    sched.add(a)
    drain(sched)
    prefill = [(r.start_pos, r.end_pos) for p in engine.plans for r in p.rows if r.kind.value == "prefill"]
    assert prefill == [(0, 8), (8, 10)], "the chunk ends at 8 so the state there can be kept"
    # checkpoints at 8 (prompt) and at 12 (reached while decoding); the copy at 12 was queued by
    # the last step, so it runs first in the next plan
    assert len(engine.copies) == 1 and sched.stats().checkpoints == 2
    follow = Request("b", tuple(a.all_token_ids) + (5, 6), SamplingParams(max_tokens=4))
    sched.add(follow)
    events = drain(sched)
    row = first_row(engine, "b")
    save, restore = engine.copies[1:3]
    assert row.start_pos == 12 and restore[1] == row.state_slot and restore[0] == save[1]
    b_plan = next(p for p in engine.plans if any(r.request_id == "b" for r in p.rows))
    assert [(op.src, op.dst) for op in b_plan.state_ops] == [save, restore], "saved, then restored"
    assert tokens(events["b"]) == run_alone("b", follow.prompt_token_ids, 4, block_size=4,
                                            num_state_slots=1)
    assert sched.stats().checkpoint_hits_total == 1 and sched.stats().slots_used == 0


def test_a_wrong_restore_changes_the_fake_engines_tokens():
    """The fake's recurrent state feeds its tokens: restoring another prefix's checkpoint at the
    same position must not go unnoticed."""
    sched, engine, _ = make_scheduler(**HYBRID)
    x, y = make_request("x", 9, max_tokens=1, seed=1), make_request("y", 9, max_tokens=1, seed=2)
    for req in (x, y):
        sched.add(req)
        drain(sched)
    y_checkpoint = engine.copies[-1][1]      # y's state at position 8
    right = engine.copy_state

    def wrong_restore(src: int, dst: int) -> None:     # the next copy is the restore
        engine.copy_state = right
        right(y_checkpoint, dst)

    engine.copy_state = wrong_restore
    follow = Request("b", x.prompt_token_ids + (5, 6), SamplingParams(max_tokens=4))
    sched.add(follow)
    got = tokens(drain(sched)["b"])
    assert first_row(engine, "b").start_pos == 8
    assert got != run_alone("b", follow.prompt_token_ids, 4, block_size=4, num_state_slots=1)


def test_checkpoints_count_as_free_slots_and_are_evicted_least_recently_used():
    sched, engine, _ = make_scheduler(prefix_cache=True, block_size=4, num_state_slots=2, max_rows=1)
    sched.add(make_request("a", 10, max_tokens=3))
    drain(sched)
    # one spare slot: the checkpoint at 12 replaced the one at 8
    st_ = sched.stats()
    assert (st_.checkpoints, st_.checkpoint_evictions_total, st_.slots_used) == (1, 1, 0)
    sched.add(make_request("b", 5, max_tokens=2, seed=3))   # takes the free slot, keeps the checkpoint
    sched.add(make_request("c", 5, max_tokens=2, seed=4))
    drain(sched)
    assert sched.stats().slots_used == 0


# ---- random workloads ------------------------------------------------------------------------------
CONFIGS = st.fixed_dictionaries({
    "block_size": st.sampled_from([1, 2, 4]),
    "num_blocks": st.integers(6, 24),
    "max_rows": st.integers(1, 4),
    "num_state_slots": st.sampled_from([0, 0, 2, 4, 6]),
    "max_prefill_tokens_per_row": st.integers(1, 16),
    "max_prefill_tokens_total": st.integers(1, 24),
    "prefill_quantum": st.integers(1, 8),
})
OPS = st.lists(st.tuples(st.sampled_from(["add", "add", "follow", "follow", "step", "step", "step",
                                          "cancel", "fail_row"]),
                         st.integers(0, 10**6)), min_size=5, max_size=50)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=CONFIGS, ops=OPS)
def test_random_workloads_share_blocks_safely_and_keep_outputs(cfg, ops):
    cfg = dict(cfg, max_model_len=64, vocab=50)
    if cfg["num_state_slots"]:
        cfg["num_state_slots"] = max(cfg["num_state_slots"], cfg["max_rows"])
    sched, engine, _ = make_scheduler(prefix_cache=True, **cfg)
    alloc, bs, execute = sched.kv.blocks, cfg["block_size"], engine.execute

    broken: list[AssertionError] = []

    def checked_execute(plan):
        try:
            for row in plan.rows:
                table = sched.get(row.request_id).block_ids     # what the engine will hold
                for block in {table[p // bs] for p in range(row.start_pos, row.end_pos)}:
                    assert alloc.refcount(block) == 1, f"{row.request_id} writes shared block {block}"
                    assert not alloc.cache.is_cached(block), f"{row.request_id} writes cached block {block}"
            return execute(plan)
        except AssertionError as exc:   # the scheduler would turn it into a step error: keep it
            broken.append(exc)
            raise

    engine.execute = checked_execute
    added: list[Request] = []
    for op, seed in ops:
        pick = added[seed % len(added)] if added else None
        if op in ("add", "follow"):
            base = tuple(pick.all_token_ids) if op == "follow" and pick else make_request("", 1 + seed % 12,
                                                                                 seed=seed % 3).prompt_token_ids
            ids = base + tuple(range(1, 1 + seed % 5))
            req = Request(f"r{len(added)}", ids[:40], SamplingParams(max_tokens=1 + seed % 6))
            if -(-len(req.prompt_token_ids) // bs) + 1 <= cfg["num_blocks"]:
                sched.add(req)
                added.append(req)
        elif op == "step":
            sched.step()
        elif op == "cancel" and pick:
            sched.cancel(pick.id)
        elif op == "fail_row" and pick:
            engine.fail_rows.add(pick.id)
    drain(sched)
    assert not broken, broken[0]
    assert sched.stats().blocks_used == 0 and sched.stats().slots_used == 0
    assert alloc.num_free == cfg["num_blocks"], "cached-but-idle blocks count as free"
    ref_kw = dict(block_size=bs, vocab=50, max_model_len=64, num_state_slots=min(1, cfg["num_state_slots"]))
    for req in added:
        cached = req.num_cached_tokens or 0
        assert cached % bs == 0 and cached < len(req.prompt_token_ids), req.id
        if req.finish_reason in (FinishReason.LENGTH, FinishReason.STOP):
            want = run_alone(req.id, req.prompt_token_ids, req.params.max_tokens, **ref_kw)
            assert req.output_token_ids == want[:len(req.output_token_ids)], req.id


def test_choices_of_one_completion_wait_for_the_first_and_share_its_prompt_blocks():
    # n = 3 choices of one 18-token prompt: the first computes it, the others start from its 4 full
    # blocks (held by all three at once) and recompute only the last partial block
    sched, engine, _ = make_scheduler(prefix_cache=True, block_size=4, max_rows=3,
                                      max_prefill_tokens_total=8, prefill_quantum=8)
    ids = prompt(18)
    sched.add(Request("c", ids, SamplingParams(max_tokens=6)))
    for i in (1, 2):
        sched.add(Request(f"c-{i}", ids, SamplingParams(max_tokens=6), after="c"))
    shared = []
    for _ in range(100):
        if not sched.has_work:
            break
        sched.step()
        check_invariants(sched)
        running = {r.id: r for r in sched._running}
        if len(running) == 3:
            shared.append([sched.kv.blocks.refcount(b) for b in running["c-1"].block_ids[:4]])
    first = {rid: first_row(engine, rid) for rid in ("c-1", "c-2")}
    table = [t["c"] for t in engine.tables if "c" in t][-1]
    assert all(first[r].start_pos == 16 and first[r].new_blocks[:4] == table[:4] for r in first)
    # no follower ran before the first choice's prompt was computed
    plans = [{row.request_id for row in p.rows} for p in engine.plans]
    done = next(k for k, p in enumerate(engine.plans)
                for row in p.rows if row.request_id == "c" and row.sample)
    assert not any({"c-1", "c-2"} & rows for rows in plans[:done + 1])
    assert shared and all(counts == [3, 3, 3, 3] for counts in shared)
    assert sched.stats().blocks_used == 0


def test_a_request_sharing_a_prompt_being_computed_waits_for_its_blocks():
    # agents started at once with one 40-token system prompt and their own questions: the second is
    # admitted once the first has computed the shared blocks and starts from them, rather than compute
    # them alongside it; one sharing less than a chunk (max_prefill_tokens_per_row, 8) does not wait
    system = prompt(40)
    for other, shares in ((system + prompt(6, seed=2), 40), (system[:6] + prompt(30, seed=3), 0)):
        sched, engine, _ = make_scheduler(prefix_cache=True, block_size=4, max_rows=3, max_prefill_tokens_per_row=8,
                                          max_prefill_tokens_total=16, prefill_quantum=8)
        first = Request("a", system + prompt(6, seed=1), SamplingParams(max_tokens=3))
        second = Request("b", other, SamplingParams(max_tokens=3))
        sched.add(first), sched.add(second)
        events = drain(sched)
        assert second.num_cached_tokens == shares and first_row(engine, "b").start_pos == shares
        plans = [{row.request_id for row in p.rows} for p in engine.plans]
        assert ("b" in plans[0]) == (shares == 0)       # the short share ran from the first step
        for req in (first, second):
            assert tokens(events[req.id]) == run_alone(req.id, req.prompt_token_ids, 3, block_size=4)


def test_a_follower_without_the_prefix_cache_just_computes_its_prompt():
    sched, engine, _ = make_scheduler(prefix_cache=False, block_size=4, max_rows=2)
    ids = prompt(10)
    sched.add(Request("c", ids, SamplingParams(max_tokens=3)))
    sched.add(Request("c-1", ids, SamplingParams(max_tokens=3), after="c"))
    events = drain(sched)
    assert first_row(engine, "c-1").start_pos == 0 and len(tokens(events["c-1"])) == 3
