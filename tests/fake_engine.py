"""A scripted SeqEngine for scheduler tests: no model, deterministic tokens, injectable failures.

It keeps a fake paged K/V store: each fed token is written to (block, offset) from the row's block
table, and a sampled token is a hash of the request id and the tokens READ BACK through the block
table. So a wrong block table, a block shared by two requests or a lost block changes the output
(or raises), and outputs are a pure function of (request, previous tokens) as the tests need.
With state slots it checks that a slot is reset before a request starts and never shared.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field, replace
from typing import Callable

from engine.contracts import EngineLimits, RowOutput, StepPlan, StepResult
from engine.request import Request, SamplingParams
from engine.scheduler import Event, Scheduler


def fake_token(request_id: str, history: tuple[int, ...], vocab: int) -> int:
    digest = hashlib.blake2b(f"{request_id}|{history}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % vocab


@dataclass
class FakeEngine:
    max_rows: int = 4
    block_size: int = 4
    num_blocks: int = 64
    num_state_slots: int = 0
    max_model_len: int = 2048
    max_prefill_rows: int = 4
    max_prefill_tokens_per_row: int = 64
    max_prefill_tokens_total: int = 64
    prefill_quantum: int = 16
    mixed_prefill_tokens_total: int | None = None   # capacity when decode rows are present
    vocab: int = 1000
    honor_bans: bool = True                              # False: a sampler that ignores the mask
    forced: dict[tuple[str, int], int] = field(default_factory=dict)  # (id, sample_index) -> token
    fail_rows: set[str] = field(default_factory=set)     # these requests' next rows fail (once)
    raise_on_steps: set[int] = field(default_factory=set)
    error_on_steps: set[int] = field(default_factory=set)
    tamper: Callable[[StepPlan, StepResult], StepResult] | None = None  # a contract-breaking engine
    plans: list[StepPlan] = field(default_factory=list)
    limit_calls: list[int] = field(default_factory=list)
    resets: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._kv: dict[tuple[int, int], tuple[str, int]] = {}
        self._slot_owner: dict[int, tuple[str, int] | None] = {}

    def limits(self, decode_rows: int) -> EngineLimits:
        self.limit_calls.append(decode_rows)
        total = self.max_prefill_tokens_total
        if decode_rows and self.mixed_prefill_tokens_total is not None:
            total = self.mixed_prefill_tokens_total
        return EngineLimits(self.max_rows, self.block_size, self.num_blocks, self.num_state_slots,
                            self.max_model_len, self.max_prefill_rows,
                            self.max_prefill_tokens_per_row, total, self.prefill_quantum)

    def reset_state(self, slot: int) -> None:
        assert 0 <= slot < self.num_state_slots, f"slot {slot} out of range"
        self.resets.append(slot)
        self._slot_owner[slot] = None

    def execute(self, plan: StepPlan) -> StepResult:
        self.plans.append(plan)
        if plan.step in self.raise_on_steps:
            raise RuntimeError(f"injected failure in step {plan.step}")
        if plan.step in self.error_on_steps:
            return StepResult(plan.step, error=f"injected step error {plan.step}")
        outs = tuple(self._run_row(row) for row in plan.rows)
        result = StepResult(plan.step, outs)
        return self.tamper(plan, result) if self.tamper else result

    def _run_row(self, row) -> RowOutput:
        if row.request_id in self.fail_rows:
            self.fail_rows.discard(row.request_id)
            return RowOutput(row.request_id, error=f"injected row error for {row.request_id}")
        bs = self.block_size
        assert len(row.block_table) * bs >= row.end_pos, f"{row.request_id}: block table too short"
        if row.state_slot is not None:
            owner = self._slot_owner.get(row.state_slot)
            expected = None if row.start_pos == 0 else (row.request_id, row.start_pos)
            assert owner == expected, f"slot {row.state_slot} holds {owner}, expected {expected}"
            self._slot_owner[row.state_slot] = (row.request_id, row.end_pos)
        for i, tok in enumerate(row.token_ids):
            pos = row.start_pos + i
            self._kv[(row.block_table[pos // bs], pos % bs)] = (row.request_id, tok)
        if not row.sample:
            return RowOutput(row.request_id)
        history = []
        for pos in range(row.end_pos):
            owner, tok = self._kv[(row.block_table[pos // bs], pos % bs)]
            assert owner == row.request_id, f"{row.request_id} reads {owner}'s K/V at position {pos}"
            history.append(tok)
        token = self.forced.get((row.request_id, row.sample_index),
                                fake_token(row.request_id, tuple(history), self.vocab))
        if self.honor_bans and token in row.banned_token_ids:   # like a sampler's mask: take the next allowed id
            token = next(t for t in range(self.vocab) if t not in row.banned_token_ids)
        return RowOutput(row.request_id, token=token)


def drop_last_row(plan: StepPlan, result: StepResult) -> StepResult:
    return replace(result, rows=result.rows[:-1])


class ManualClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def prompt(n: int, seed: int = 0) -> tuple[int, ...]:
    return tuple((seed * 31 + i * 7) % 997 + 1 for i in range(n))


def make_request(rid: str, n: int, max_tokens: int = 8, eos: tuple[int, ...] = (),
                 seed: int = 0, **params) -> Request:
    return Request(rid, prompt(n, seed), SamplingParams(max_tokens=max_tokens, **params), eos)


def make_scheduler(max_waiting: int | None = None, **engine_kw) -> tuple[Scheduler, FakeEngine, ManualClock]:
    engine, clock = FakeEngine(**engine_kw), ManualClock()
    return Scheduler(engine, max_waiting=max_waiting, clock=clock), engine, clock


def check_invariants(sched: Scheduler) -> None:
    """Blocks owned once, pool accounting closed, concurrency bounded."""
    st = sched.stats()
    assert st.blocks_used + st.blocks_free + st.blocks_reserved == st.blocks_total
    owned = [b for r in sched._running for b in r.block_ids]
    assert len(owned) == len(set(owned)) == st.blocks_used, "a block is owned twice or leaked"
    slots = [r.state_slot for r in sched._running if r.state_slot is not None]
    assert len(slots) == len(set(slots)) == st.slots_used
    assert st.running + st.paused <= sched._limits.max_rows


def drain(sched: Scheduler, max_steps: int = 5000) -> dict[str, list[Event]]:
    """Step until idle; events by request id. Checks invariants after every step."""
    events: dict[str, list[Event]] = {}
    for _ in range(max_steps):
        if not sched.has_work:
            break
        for ev in sched.step():
            events.setdefault(ev.request_id, []).append(ev)
        check_invariants(sched)
    assert not sched.has_work, "scheduler did not drain"
    st = sched.stats()
    assert (st.blocks_used, st.blocks_reserved, st.slots_used) == (0, 0, 0)
    return events


def tokens(events: list[Event]) -> list[int]:
    return [e.token for e in events if e.token is not None]
