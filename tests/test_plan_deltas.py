"""Plans as deltas (engine/contracts.py, engine/plan_ledger.py): what rows carry, what the engine
keeps, a logged run replayed into a new engine, penalties from running counts, and per-step work
that does not grow with the context."""
from __future__ import annotations

import gc
import sys
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from fake_engine import drain, make_request, make_scheduler, record_plans
from tiny_models import hf_model

from engine import LLM, SamplingParams
from engine.client import EngineClient
from engine.contracts import PENDING, ContractError, PlanRow, RowKind, StepPlan
from engine.plan_ledger import PlanLedger

PARAMS = SamplingParams(temperature=0)


def _row(rid, start, tokens=(5,), blocks=(), fresh=False):
    return PlanRow(rid, RowKind.DECODE if len(tokens) == 1 else RowKind.PREFILL, tuple(tokens), start,
                   tuple(blocks), None, True, PARAMS, fresh=fresh)


# ---- the ledger -----------------------------------------------------------------------------------
def test_the_ledger_keeps_tables_from_deltas_and_refuses_broken_ones():
    ledger = PlanLedger(max_rows=2)
    plan = StepPlan(0, (_row("a", 0, (1, 2, 3), (7,), fresh=True), _row("b", 4, (9,), (3, 4), fresh=True)))
    _, recs = ledger.begin(plan)
    ledger.commit(plan, recs)
    assert [(r.block_table, r.computed) for r in recs] == [([7], 3), ([3, 4], 5)]
    plan = StepPlan(1, (_row("a", 3, blocks=(8,)), _row("b", 5)))
    _, recs = ledger.begin(plan)
    ledger.commit(plan, recs)
    assert ledger.records["a"].block_table == [7, 8] and ledger.records["b"].computed == 6
    with pytest.raises(ContractError, match="starts at 3; the engine has computed 4"):
        ledger.begin(StepPlan(2, (_row("a", 3),)))
    with pytest.raises(ContractError, match="holds no record"):
        ledger.begin(StepPlan(2, (_row("c", 0),)))
    with pytest.raises(ContractError, match="still holds"):
        ledger.begin(StepPlan(2, (_row("a", 0, fresh=True),)))
    with pytest.raises(ContractError, match="more live requests"):
        ledger.begin(StepPlan(2, (_row("c", 0, fresh=True),)))
    closed, recs = ledger.begin(StepPlan(2, (_row("c", 0, blocks=(1,), fresh=True),), forget=("a",)))
    assert [r.request_id for r in closed] == ["a"] and recs[0].index == closed[0].index


# ---- what the scheduler sends ---------------------------------------------------------------------
def test_rows_carry_the_whole_table_once_then_only_new_blocks():
    sched, engine, _ = make_scheduler(block_size=4, num_blocks=40)
    sched.add(make_request("a", 6, max_tokens=12))
    drain(sched)
    rows = [r for p in engine.plans for r in p.rows]
    assert rows[0].fresh and len(rows[0].new_blocks) == 2 and not any(r.fresh for r in rows[1:])
    sent = [b for r in rows for b in r.new_blocks]
    assert sent == list(engine.tables[-1]["a"]) and len(sent) == len(set(sent)) == 5
    assert [len(r.new_blocks) for r in rows[1:]] == [0, 0, 1, 0, 0, 0, 1, 0, 0, 0, 1]   # positions 8, 12, 16
    assert engine.plans[-1].forget == () and sched.step() == []


def test_a_preempted_request_is_forgotten_then_sent_fresh():
    sched, engine, _ = make_scheduler(block_size=2, num_blocks=6)     # B preempts itself in step 3
    sched.add(make_request("A", 3, max_tokens=6))
    sched.add(make_request("B", 4, max_tokens=6))
    drain(sched)
    forgot = [k for k, p in enumerate(engine.plans) if "B" in p.forget]
    assert forgot, "B was preempted"
    again = next(r for p in engine.plans[forgot[0]:] for r in p.rows if r.request_id == "B")
    assert again.fresh and again.start_pos == 0
    sched.add(make_request("C", 2, max_tokens=1))      # the next plan closes B's record
    sched.step()
    assert engine.plans[-1].forget == ("B",) and list(engine.ledger.records) == ["C"]


# ---- a logged run replayed --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model_path(tiny_checkpoint):
    return str(tiny_checkpoint("qwen3", tied=False, heads=8, kv_heads=2, head_dim=32, max_pos=2048))


def _llm(path, **kw):
    return LLM(model=path, dtype="float32", max_model_len=96, **kw)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "q8_0", "q4_0"])
def test_plans_replayed_into_a_new_engine_reproduce_its_state(model_path, kv_cache_dtype):
    """Preemption, prefix hits and penalties: the log alone rebuilds the tables, the K/V pool (16-bit or
    quantized, bytes equal) and every sampled token in an engine that never saw the scheduler."""
    llm = _llm(model_path, kv_pool_tokens=160, max_concurrency=4, kv_cache_dtype=kv_cache_dtype)
    # what /props and the console header show (EngineClient.info reads only .engine; a client would start the loop)
    shown = EngineClient.info(SimpleNamespace(engine=llm.engine)).kv_cache_dtype
    assert shown == {"auto": "bfloat16"}.get(kv_cache_dtype, kv_cache_dtype)
    log = record_plans(llm.engine)
    shared = list(range(10, 27))                      # one full block, cached by the first call
    llm.generate([shared + [1]], SamplingParams(temperature=0, max_tokens=4))
    prompts = [shared + [3], list(range(60, 65)), list(range(100, 105)), shared + [4]]
    params = [SamplingParams(temperature=0, max_tokens=60, ignore_eos=True, repetition_penalty=1.3,
                             frequency_penalty=0.4),
              SamplingParams(temperature=0, max_tokens=60, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=60, ignore_eos=True, presence_penalty=0.5),
              SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)]
    llm.generate(prompts, params)               # 4 x ~78 tokens in a 160-token pool: preemptions
    assert llm.engine.scheduler.stats().preemptions_total > 0
    assert llm.engine.scheduler.stats().prefix_cache_hit_tokens > 0
    fresh = _llm(model_path, kv_pool_tokens=160, max_concurrency=4, kv_cache_dtype=kv_cache_dtype).engine.runner
    for plan, result in log:
        assert fresh.execute(plan) == result, f"step {plan.step}"
    old = llm.engine.runner
    assert {r: (v.block_table, v.computed) for r, v in fresh.ledger.records.items()} == \
        {r: (v.block_table, v.computed) for r, v in old.ledger.records.items()}
    for a, b in zip(fresh.pool.layers, old.pool.layers):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


# ---- penalties from running counts ------------------------------------------------------------------
def _penalised_reference(model, prompt, p: SamplingParams) -> list[int]:
    """Greedy with the penalties applied to the full history each step (transformers' logits)."""
    ids, out = list(prompt), []
    for _ in range(p.max_tokens):
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1].float()
        seen = torch.tensor(sorted(set(ids)))
        vals = logits[seen]
        logits[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if out:
            counts = torch.bincount(torch.tensor(out), minlength=logits.numel()).float()
            logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()
        tok = int(logits.argmax())
        ids.append(tok)
        out.append(tok)
    return out


def test_penalties_from_running_counts_equal_the_full_history_even_after_preemption(model_path):
    hf = hf_model(model_path)
    p = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, repetition_penalty=1.6,
                       frequency_penalty=0.8, presence_penalty=0.6)
    prompts = [[7, 8, 9, 7, 8, 9, 40], list(range(200, 236)), [5] * 20]
    llm = _llm(model_path, kv_pool_tokens=112, max_concurrency=3)   # too small: preempts
    outs = llm.generate(prompts, p)
    assert llm.engine.scheduler.stats().preemptions_total > 0
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == _penalised_reference(hf, prompt, p)


# ---- per-step work ----------------------------------------------------------------------------------
def _calls_per_step(llm, context: int, steps: int = 3) -> list[int]:
    """Python and builtin calls inside each of a few decode steps of 2 streams at ~`context`."""
    loop = llm.engine.loop
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    handles = [loop.submit([(i * 13 + k) % 400 + 1 for i in range(context)], params, bounded=False)
               for k in range(2)]
    while not all(h.lag for h in handles):
        loop.run_once()
    loop.run_once()
    counts = []
    for _ in range(steps):
        n = 0

        def count(frame, event, arg):
            nonlocal n
            n += event in ("call", "c_call")
        gc.collect()
        gc.disable()        # a collection would run other objects' finalizers inside the step
        sys.setprofile(count)
        llm.engine.scheduler.step()
        sys.setprofile(None)
        gc.enable()
        counts.append(n)
    for h in handles:
        h.cancel()
    loop.run_until_idle()
    return counts


def test_a_decode_step_does_the_same_work_at_context_100_and_10000(tiny_checkpoint):
    """Counted, not timed: the same calls per step (contexts equal mod the block size, so block
    boundaries fall on the same steps) whether each row holds 100 or 10,004 tokens."""
    path = tiny_checkpoint("qwen3", tied=False, hidden=64, layers=1, heads=2, kv_heads=2, head_dim=32,
                           max_pos=16384)
    llm = LLM(model=str(path), dtype="float32", max_model_len=10_100, kv_pool_tokens=20_480,
              max_concurrency=2, prefix_cache=False)
    short, long = _calls_per_step(llm, 100), _calls_per_step(llm, 10_004)
    assert short == long


def test_the_batch_maps_rows_that_start_mid_block_onto_their_tables(model_path):
    """The runner's flat batch, built on the host from the records: positions, slots (block id *
    block size + offset) across block boundaries, row offsets, drawn positions of a verify row, and
    a PENDING token taken from the previous step's draws."""
    llm = _llm(model_path, kv_pool_tokens=512)
    runner, bs = llm.engine.runner, llm.engine.pool.shape.block_size
    rows = [_row("a", 0, range(1, bs + 6), blocks=(7, 3), fresh=True),
            _row("b", bs - 2, (9, 8, PENDING), blocks=(4, 11), fresh=True)]
    rows[1] = replace(rows[1], num_draft=2, kind=RowKind.DECODE)      # a verify row: 2 proposals
    plan = StepPlan(0, tuple(rows))
    _, records = runner.ledger.begin(plan)
    runner._update(plan, records)
    batch = runner._batch(list(rows), records, (torch.tensor([50, 60]), {"b": 1}))
    want_pos = list(range(bs + 5)) + [bs - 2, bs - 1, bs]
    tables = [(7, 3), (4, 11)]
    row_of = [0] * (bs + 5) + [1] * 3
    assert batch.positions.tolist() == want_pos
    assert batch.slot_mapping.tolist() == [tables[r][p // bs] * bs + p % bs for r, p in zip(row_of, want_pos)]
    assert batch.input_ids.tolist() == list(range(1, bs + 6)) + [9, 8, 60]
    assert batch.query_start_loc.tolist() == [0, bs + 5, bs + 8]
    assert batch.context_lens.tolist() == [bs + 5, bs + 1]
    assert batch.logits_indices.tolist() == [bs + 4, bs + 5, bs + 6, bs + 7]   # a's last; b's last 1 + 2
    assert batch.block_tables.tolist() == [list(t) for t in tables]
    llm.close()
