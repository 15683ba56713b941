"""A scripted SeqEngine for scheduler tests: no model, deterministic tokens, injectable failures.

It keeps a fake paged K/V store: each fed token is written to (block, offset) from the row's block
table together with a digest of the prefix it was computed on (the digest READ BACK at the previous
position, like attention reads earlier K/V), and a sampled token is a hash of the request id and the
digest at the last position. So a wrong block table, a block overwritten by another request or a
lost block changes the output (or raises), while blocks shared through the prefix cache hold the
same digests as recomputed ones: outputs are a pure function of (request, previous tokens).
With state slots it models the recurrent state as a digest of every token fed into the slot, which
also feeds the sampled token: a slot that was not reset, or a wrong checkpoint restore
(copy_state), changes the output; a slot must be at the row's start position and never shared.
A verify row's draws each see the state after their own position, and its slot rolls back to the
state after the accepted run (`accepted_run`, as the runner's engine/state_rollback.py does).
A verify row draws after each of its last 1 + num_draft tokens the same way; `OracleProposer`
knows the tokens the engine will draw and proposes them with random mistakes, and so does the
engine's own fake draft model for draft_k rows when `draft_error` is set.
"""
from __future__ import annotations

import hashlib
import random
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Callable

from engine.contracts import PENDING, Draw, EngineLimits, Ready, RowOutput, StepPlan, StepResult
from engine.plan_ledger import PlanLedger
from engine.overlap_scheduler import OverlapScheduler
from engine.request import Request, SamplingParams
from engine.scheduler import Event, Scheduler
from engine.speculation import accepted_run


def fake_token(request_id: str, context: bytes, vocab: int) -> int:
    digest = hashlib.blake2b(request_id.encode() + b"|" + context, digest_size=8).digest()
    return int.from_bytes(digest, "little") % vocab


def fold(prefix: bytes, token: int) -> bytes:
    """The digest of a prefix extended by one token: fake K/V and fake recurrent state."""
    return hashlib.blake2b(prefix + token.to_bytes(8, "little", signed=True), digest_size=8).digest()


@dataclass
class _SlotState:
    digest: bytes = b""
    position: int = 0
    user: str | None = None     # the request feeding it since its last reset or restore


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
    max_verify_tokens_total: int = 0                     # decode-row tokens with proposals
    vocab: int = 1000
    honor_bans: bool = True                              # False: a sampler that ignores the mask
    draft_error: float | None = None     # a draft model: draft_k rows get oracle proposals, each wrong
                                         # with this probability (None: no draft model)
    forced: dict[tuple[str, int], int] = field(default_factory=dict)  # (id, sample_index) -> token
    fail_rows: set[str] = field(default_factory=set)     # these requests' next rows fail (once)
    raise_on_steps: set[int] = field(default_factory=set)
    error_on_steps: set[int] = field(default_factory=set)
    tamper: Callable[[StepPlan, StepResult], StepResult] | None = None  # a contract-breaking engine
    plans: list[StepPlan] = field(default_factory=list)
    # each executed plan's rows' whole block tables as the engine held them (rows carry only new blocks)
    tables: list[dict[str, tuple[int, ...]]] = field(default_factory=list)
    resets: list[int] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._kv: dict[tuple[int, int], tuple[int, bytes]] = {}    # (block, offset) -> (token, digest)
        self._slots: dict[int, _SlotState] = {}
        self.ledger = PlanLedger(self.max_rows)
        self._draft_rng = random.Random(0)
        self._drawn: dict[str, int] = {}      # the last plan's first draw per row: what PENDING stands for

    def limits(self) -> EngineLimits:
        return EngineLimits(self.max_rows, self.block_size, self.num_blocks, self.num_state_slots,
                            self.max_model_len, self.max_prefill_rows,
                            self.max_prefill_tokens_per_row, self.max_prefill_tokens_total,
                            self.prefill_quantum, self.mixed_prefill_tokens_total,
                            self.max_verify_tokens_total)

    def reset_state(self, slot: int) -> None:
        assert 0 <= slot < self.num_state_slots, f"slot {slot} out of range"
        self.resets.append(slot)
        self._slots[slot] = _SlotState()

    def copy_state(self, src_slot: int, dst_slot: int) -> None:
        for slot in (src_slot, dst_slot):
            assert 0 <= slot < self.num_state_slots, f"slot {slot} out of range"
        assert src_slot != dst_slot and src_slot in self._slots, f"bad copy {src_slot} -> {dst_slot}"
        self.copies.append((src_slot, dst_slot))
        src = self._slots[src_slot]
        self._slots[dst_slot] = _SlotState(src.digest, src.position)

    def launch(self, plan: StepPlan) -> Ready:
        return Ready(self.execute(plan))

    def execute(self, plan: StepPlan) -> StepResult:
        self.plans.append(plan)
        drawn, self._drawn = self._drawn, {}
        plan = replace(plan, rows=tuple(
            replace(r, token_ids=r.token_ids[:-1] + (drawn.get(r.request_id, PENDING),))
            if r.token_ids[-1] == PENDING else r for r in plan.rows))
        _, records = self.ledger.begin(plan)
        self.tables.append({r.request_id: tuple(rec.block_table) for r, rec in zip(plan.rows, records)})
        for op in plan.state_ops:
            if op.src is None:
                self.reset_state(op.dst)
            else:
                self.copy_state(op.src, op.dst)
        self.ledger.commit(plan, records)
        if plan.step in self.raise_on_steps:
            raise RuntimeError(f"injected failure in step {plan.step}")
        if plan.step in self.error_on_steps:
            return StepResult(plan.step, error=f"injected step error {plan.step}")
        outs = tuple(self._run_row(row, rec.block_table) for row, rec in zip(plan.rows, records))
        self._drawn = {o.request_id: o.token for o in outs if o.token is not None}
        result = StepResult(plan.step, outs)
        return self.tamper(plan, result) if self.tamper else result

    def _run_row(self, row, block_table: list[int]) -> RowOutput:
        if PENDING in row.token_ids:
            return RowOutput(row.request_id, error=f"{row.request_id}: PENDING, and the plan before drew "
                                                   "no token for it")
        if row.request_id in self.fail_rows:
            self.fail_rows.discard(row.request_id)
            return RowOutput(row.request_id, error=f"injected row error for {row.request_id}")
        bs = self.block_size
        assert len(block_table) * bs >= row.end_pos, f"{row.request_id}: block table too short"
        proposals = self._draft(row, block_table) if row.draft_k else ()
        row = row.with_proposals(proposals) if row.draft_k else row
        states = []                         # the slot's digest after each fed token
        if row.state_slot is not None:
            slot = self._slots.get(row.state_slot)
            assert slot is not None, f"slot {row.state_slot} was never reset"
            assert slot.position == row.start_pos, (f"slot {row.state_slot} holds the state at "
                                                    f"{slot.position}, the row starts at {row.start_pos}")
            assert slot.user in (None, row.request_id), f"slot {row.state_slot} is shared with {slot.user}"
            for tok in row.token_ids:
                slot.digest = fold(slot.digest, tok)
                states.append(slot.digest)
            slot.position, slot.user = row.end_pos, row.request_id
        for i, tok in enumerate(row.token_ids):
            pos = row.start_pos + i
            prefix = self._kv[(block_table[(pos - 1) // bs], (pos - 1) % bs)][1] if pos else b""
            self._kv[(block_table[pos // bs], pos % bs)] = (tok, fold(prefix, tok))
        if not row.sample:
            return RowOutput(row.request_id)
        draws = []
        for d in range(row.num_draft + 1):
            pos = row.end_pos - 1 - row.num_draft + d
            context = self._kv[(block_table[pos // bs], pos % bs)][1]
            # a correct state folds the same tokens as the K/V chain; any other state changes the token
            state = states[pos - row.start_pos] if states else None
            stray = b"" if state in (None, context) else b"stray" + state
            token = self.forced.get((row.request_id, row.sample_index + d),
                                    fake_token(row.request_id, context + stray, self.vocab))
            if self.honor_bans and token in row.banned_token_ids:   # like a sampler's mask: take the next allowed id
                token = next(t for t in range(self.vocab) if t not in row.banned_token_ids)
            draws.append(token)
        out = RowOutput(row.request_id, token=draws[0], verify=tuple(Draw(t) for t in draws[1:]),
                        proposals=proposals)
        if states and row.num_draft:
            fed = len(row.token_ids) - row.num_draft + len(accepted_run(row, out)) - 1
            slot.digest, slot.position = states[fed - 1], row.start_pos + fed
        return out

    def _draft(self, row, block_table: list[int]) -> tuple[int, ...]:
        """Up to draft_k (a random number, like a draft still catching up) of the draws the row will
        make from its K/V chain, each wrong with probability draft_error."""
        assert self.draft_error is not None, f"{row.request_id} asks for draft proposals; there is no draft"
        bs, pos = self.block_size, row.start_pos
        digest = self._kv[(block_table[(pos - 1) // bs], (pos - 1) % bs)][1] if pos else b""
        out = []
        for tok in (row.token_ids + (None,) * (row.draft_k - 1))[:self._draft_rng.randint(0, row.draft_k)]:
            digest = fold(digest, out[-1] if tok is None else tok)
            drawn = fake_token(row.request_id, digest, self.vocab)
            out.append((drawn + 1) % self.vocab if self._draft_rng.random() < self.draft_error else drawn)
        return tuple(out)


class OracleProposer:
    """Proposes the tokens a FakeEngine without forced tokens will draw, each
    replaced by a wrong one with probability `error`: random acceptance lengths."""

    def __init__(self, vocab: int, error: float = 0.3, seed: int = 0) -> None:
        self.vocab, self.error = vocab, error
        self.rng = random.Random(seed)

    def propose(self, req: Request, k: int) -> tuple[int, ...]:
        digest = b""
        for tok in req.all_token_ids:
            digest = fold(digest, tok)
        out = []
        for _ in range(k):
            tok = fake_token(req.id, digest, self.vocab)
            out.append((tok + 1) % self.vocab if self.rng.random() < self.error else tok)
            digest = fold(digest, out[-1])
        return tuple(out)

    def forget(self, request_id: str) -> None:
        pass


def record_plans(engine) -> list[tuple[StepPlan, StepResult]]:
    """Log every (plan, result) a real engine's runner executes from now on."""
    log, execute = [], engine.runner.execute

    def recording(plan):
        result = execute(plan)
        log.append((plan, result))
        return result
    engine.runner.execute = recording
    return log


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


def make_scheduler(max_waiting: int | None = None, prefix_cache: bool = False, speculator=None,
                   overlap: bool = False, **engine_kw) -> tuple[Scheduler, FakeEngine, ManualClock]:
    engine, clock = FakeEngine(**engine_kw), ManualClock()
    sched = (OverlapScheduler if overlap else Scheduler)(engine, max_waiting=max_waiting, clock=clock,
                                                         prefix_cache=prefix_cache, speculator=speculator)
    return sched, engine, clock


def check_invariants(sched: Scheduler) -> None:
    """Blocks owned once (or shared exactly by their reference count), pool accounting closed,
    concurrency bounded."""
    st = sched.stats()
    assert st.blocks_used + st.blocks_free + st.blocks_reserved == st.blocks_total
    owned = Counter(b for r in sched._running for b in r.block_ids)
    assert len(owned) == st.blocks_used, "a block is leaked"
    for block, holders in owned.items():
        assert holders == sched.kv.blocks.refcount(block), f"block {block}: refcount != holders"
        assert holders == 1 or sched.kv.blocks.cache.is_cached(block), f"uncached block {block} shared"
    slots = [r.state_slot for r in sched._running if r.state_slot is not None]
    assert len(slots) == len(set(slots)) == st.slots_used
    assert st.running + st.paused <= sched._limits.max_rows


PER_REQUEST_OPS = ("cancel", "pause", "resume", "fail_row")


def act_on(sched: Scheduler, engine: FakeEngine, op: str, request_id: str) -> None:
    """A random workload's operation on one request (PER_REQUEST_OPS; fail_row: its next row fails)."""
    if op == "cancel":
        sched.cancel(request_id)
    elif op == "pause":
        sched.pause(request_id)
    elif op == "resume":
        sched.resume(request_id)
    elif op == "fail_row":
        engine.fail_rows.add(request_id)
    else:
        raise ValueError(f"{op!r} is not one of {PER_REQUEST_OPS}")


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
