"""Continuous batching (DESIGN.md "Scheduler behaviours" 1-8): FIFO claim-only admission, fair
round-robin prefill grants next to decode rows in one plan, preemption by recompute, retirement.

There are no prefill/decode phases: every step each running request catches its computed tokens
up towards all_token_ids, decoders one token, prefillers a granted chunk. No torch here.

Prefix caching and hybrid state checkpoints: engine/prefix_reuse.py; prefill fairness:
engine/prefill_rotation.py; speculative decoding (verify rows): engine/speculation.py.
"""
from __future__ import annotations

import time
from collections import deque
from typing import Callable

from engine.contracts import (PENDING, ContractError, Draw, Launched, PlanRow, Ready, RowKind, RowOutput,
                              SeqEngine, StepPlan, StepResult, check_plan, check_result)
from engine.kv.allocator import BlockHandle, Reservation
from engine.kv.prefix_cache import CheckpointCache, PrefixCache
from engine.kv.resources import KVResources
from engine.prefill_rotation import PrefillRotation
from engine.prefix_reuse import PrefixReuse
from engine.request import Event, FinishReason, Request, RequestState
from engine.speculation import Proposal, Speculator
from engine.errors import PromptTooLong, QueueFull, RequestRejected
from engine.stats import RequestRow, SchedulerStats, StatsRecorder, percentile

__all__ = ["Event", "QueueFull", "RequestRejected", "Scheduler"]


class Scheduler:
    overlapped = False      # engine/overlap_scheduler.py: the next step is planned while one runs
    in_flight = False       # ... and there, whether a launched step's result is unread

    def __init__(self, engine: SeqEngine, *, max_waiting: int | None = None,
                 clock: Callable[[], float] = time.monotonic, prefix_cache: bool = True,
                 speculator: Speculator | None = None) -> None:
        self.engine = engine
        self._limits = lim = engine.limits()
        self.kv = KVResources(      # public: a warm restart (engine/kv/snapshot.py) saves and refills its cache
            lim.num_blocks, lim.num_state_slots, PrefixCache(lim.block_size) if prefix_cache else None,
            CheckpointCache() if prefix_cache and lim.num_state_slots else None)
        self._prefix = PrefixReuse(lim.block_size, self.kv)
        self._max_waiting = max_waiting
        self._clock = clock
        self._waiting: deque[Request] = deque()
        self._running: list[Request] = []   # admitted (prefill, decode, paused), oldest first
        self._live: dict[str, Request] = {}
        self._reservations: dict[str, Reservation] = {}
        self._rotation = PrefillRotation()
        self._outstanding: StepPlan | None = None
        self._planned: dict[str, Request] = {}
        self._next_step = 0
        self._pending: list[Event] = []
        self._forget: list[str] = []        # released since the last plan, held by the engine
        self._preemptions = 0
        self._recorder = StatsRecorder(clock)
        self._spec = speculator
        self._draft_reads = speculator is not None and speculator.engine_drafts   # cached prefixes too

    # ---- requests in --------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        self.check(request.id, len(request.prompt_token_ids))
        lim, n = self._limits, len(request.prompt_token_ids)
        # the last generated token is never fed, and a preempted request must fit again on its own
        pool_room = (lim.num_blocks - 1) * lim.block_size - n + 1
        request.max_tokens = min(request.params.max_tokens, lim.max_model_len - n, pool_room)
        if request.arrival_time is None:
            request.arrival_time = self._clock()
        request.state = RequestState.WAITING
        self._live[request.id] = request
        self._waiting.append(request)

    def check(self, request_id: str, n: int) -> None:
        """Would a request with this id and an n-token prompt be accepted now? Raises
        RequestRejected or QueueFull if not. Reads only; front ends call it to answer early."""
        lim = self._limits
        if request_id in self._live:
            raise RequestRejected(f"request id {request_id!r} is already live; ids must be unique")
        if n == 0:
            raise RequestRejected("prompt is empty; send at least one token")
        if n >= lim.max_model_len:
            raise PromptTooLong(f"prompt has {n:,} tokens; max_model_len is {lim.max_model_len:,} (the prompt "
                                "must leave room for at least one generated token)", n, lim.max_model_len - 1)
        need = self._blocks_for(n) + 1
        if need > lim.num_blocks:
            raise PromptTooLong(f"prompt has {n:,} tokens and needs {need:,} K/V blocks of {lim.block_size} tokens; "
                                f"the pool has {lim.num_blocks:,} blocks (raise the K/V pool size)",
                                n, (lim.num_blocks - 1) * lim.block_size)
        if self._max_waiting is not None and len(self._waiting) >= self._max_waiting:
            raise QueueFull(f"{len(self._waiting)} requests are waiting (max_waiting="
                            f"{self._max_waiting}); retry later")

    def cancel(self, request_id: str) -> bool:
        return self.finish(request_id, FinishReason.CANCELLED)

    def finish(self, request_id: str, reason: FinishReason = FinishReason.STOP,
               tokens: int | None = None) -> bool:
        """Retire now (stop string matched above us, or cancel), keeping the first `tokens`
        outputs if given (a stop string inside a run of accepted tokens); the final event comes
        with the next step(). False if the request is unknown or already finished."""
        req = self._live.get(request_id)
        if req is None:
            return False
        if tokens is not None:
            req.truncate_output(tokens)
        self._pending.append(self._retire(req, reason))
        return True

    def pause(self, request_id: str) -> bool:
        req = self._live.get(request_id)
        if req is None:
            return False
        req.pause_requested = True
        if req.state is RequestState.DECODE:
            req.state = RequestState.PAUSED
        return True

    def resume(self, request_id: str) -> bool:
        req = self._live.get(request_id)
        if req is None:
            return False
        req.pause_requested = False
        if req.state is RequestState.PAUSED:
            req.state = RequestState.DECODE
        return True

    # ---- queries ------------------------------------------------------------------------------
    @property
    def has_work(self) -> bool:
        """Live requests, or final events of cancel/finish that step() has yet to hand out."""
        return bool(self._live or self._pending)

    @property
    def num_active(self) -> int:
        """Admitted requests that are not paused: they get rows in the next plan."""
        return sum(r.state is not RequestState.PAUSED for r in self._running)

    def get(self, request_id: str) -> Request | None:
        """A live request (waiting or admitted); None once finished."""
        return self._live.get(request_id)

    def stats(self) -> SchedulerStats:
        now, alloc = self._clock(), self.kv.blocks
        paused = sum(r.state is RequestState.PAUSED for r in self._running)
        prompt_rate, gen_rate = self._recorder.rates()
        rows = tuple(RequestRow.of(r, now) for r in [*self._running, *self._waiting])
        return SchedulerStats(
            running=len(self._running) - paused, waiting=len(self._waiting), paused=paused,
            blocks_used=alloc.num_used, blocks_free=alloc.num_free,
            blocks_reserved=alloc.num_reserved, blocks_total=alloc.num_blocks,
            slots_total=self._limits.num_state_slots, preemptions_total=self._preemptions,
            prompt_tokens_total=self._recorder.prompt_tokens_total,
            generation_tokens_total=self._recorder.generation_tokens_total,
            prompt_tokens_per_s=prompt_rate, generation_tokens_per_s=gen_rate,
            ttft_p50_s=percentile(self._recorder.ttft, 50),
            itl_p50_s=percentile(self._recorder.itl, 50), itl_p99_s=percentile(self._recorder.itl, 99),
            requests=rows, steps_total=self._next_step, **self._prefix.stats(),
            **(self._spec.stats() if self._spec else {}))

    # ---- one step -----------------------------------------------------------------------------
    def step(self) -> list[Event]:
        """Pending cancel/finish events, then schedule -> engine.execute -> apply. An engine
        exception or a result that breaks the contract fails the plan's requests, not the loop."""
        events, self._pending = self._pending, []
        plan = self.schedule()
        if plan is None:
            return events
        return events + self._apply_checked(plan, self._launch(plan).result())

    def _launch(self, plan: StepPlan) -> Launched:
        try:
            return self._start(plan)
        except Exception as exc:  # noqa: BLE001 - any engine failure becomes a step failure
            return Ready(StepResult(plan.step, error=f"{type(exc).__name__}: {exc}"))

    def _start(self, plan: StepPlan) -> Launched:
        return Ready(self.engine.execute(plan))

    def _apply_checked(self, plan: StepPlan, result: StepResult) -> list[Event]:
        try:
            return self.apply(plan, result)
        except ContractError as exc:
            return self.apply(plan, StepResult(plan.step, error=f"engine broke the step contract: {exc}"))

    def schedule(self) -> StepPlan | None:
        if self._outstanding is not None:
            raise ContractError(f"plan {self._outstanding.step} is outstanding; apply its result first")
        decoders = self._grow_decoders()
        self._admit()
        lim = self._limits
        row_cap = min(lim.max_prefill_rows, lim.max_rows - len(decoders))
        grants = self._rotation.grant(
            lambda rid: self._prefix.prefill_end(self._live[rid]) - self._live[rid].num_computed_tokens,
            lim.prefill_tokens_total(len(decoders)), row_cap=row_cap, quantum=lim.prefill_quantum,
            per_row=lim.max_prefill_tokens_per_row)
        drafts = self._spec.plan(decoders, lim.verify_tokens(len(decoders)), self._cover) if self._spec else {}
        rows = [self._row(r, RowKind.DECODE, 1, drafts.get(r.id, ())) for r in decoders]
        rows += [self._row(self._live[rid], RowKind.PREFILL, n) for rid, n in grants.items()]
        if not rows:
            return None
        plan = StepPlan(self._next_step, tuple(rows), tuple(self._forget), self._prefix.take_ops())
        self._forget = []
        check_plan(plan, {r.id for r in self._running if r.state is RequestState.DECODE})
        self._next_step += 1
        self._outstanding = plan
        self._planned = {row.request_id: self._live[row.request_id] for row in rows}
        return plan

    def apply(self, plan: StepPlan, result: StepResult) -> list[Event]:
        if plan is not self._outstanding:
            raise ContractError(f"plan {plan.step} is not the outstanding plan "
                                f"({'none' if self._outstanding is None else self._outstanding.step}); "
                                "a stale or duplicate result is never applied")
        check_result(plan, result)
        self._outstanding, planned, self._planned = None, self._planned, {}
        if result.error is not None:
            return [self._retire(req, FinishReason.ERROR, error=result.error)
                    for req in planned.values() if req.state is not RequestState.FINISHED]
        events: list[Event] = []
        prompt_fed = generated = 0
        for row, out in zip(plan.rows, result.rows):
            req = planned[row.request_id]
            if req.state is RequestState.FINISHED:      # cancelled or finished while it ran
                continue
            if out.error is not None:
                events.append(self._retire(req, FinishReason.ERROR, error=out.error))
                continue
            if row.kind is RowKind.PREFILL:
                prompt_fed += len(row.token_ids)
            if row.draft_k:
                row = row.with_proposals(out.proposals)
            taken = self._take(req, row, (self._spec.accept(row, out) if row.num_draft else [out])
                               if row.sample else [])
            generated += len(taken)
            events += taken
        self._recorder.record_step(prompt_fed, generated)
        return events

    # ---- internals ----------------------------------------------------------------------------
    def _blocks_for(self, positions: int) -> int:
        return -(-positions // self._limits.block_size)

    def _take(self, req: Request, row: PlanRow, run: list[RowOutput | Draw]) -> list[Event]:
        """After a row ran: its kept draws, one token at a time (a finish cuts a verify row's run
        there); the computed positions end before the last token, full blocks are indexed, and
        blocks past the request's tokens (a verify row's rejected positions) go back now."""
        events, reason, error = [], None, None
        for draw in run:
            reason, error = self._append(req, draw)
            if reason is not None:
                break
            events.append(Event.of(req, None, None, draw))
        req.num_computed_tokens = len(req.all_token_ids) - 1 if row.sample else row.end_pos
        if row.kind is RowKind.DECODE:      # a verify row's rejected (or never made) proposals
            self.kv.blocks.free(reversed(req.take_blocks(self._blocks_for(len(req.all_token_ids)))))
        self._prefix.remember(req, row, cut=len(events) + 1 < len(run))
        if reason is not None:
            events.append(self._retire(req, reason, error=error, out=draw))
        return events

    def _append(self, req: Request, draw: RowOutput | Draw) -> tuple[FinishReason | None, str | None]:
        """One drawn token into the request; the reason (and error) it finishes with, if any."""
        if draw.token != PENDING:      # an assumed draw's time is taken when it is known (settle)
            self._recorder.token_drawn(req)
        req.append_output(draw.token)
        if req.state is RequestState.PREFILL:
            self._rotation.discard(req.id)
            req.state = RequestState.PAUSED if req.pause_requested else RequestState.DECODE
        if req.matcher is not None and not req.matcher.accept(draw.token):
            return FinishReason.ERROR, f"the grammar refused token {draw.token}: {req.matcher.error}"
        return req.finished_by_last_token(self._limits.max_model_len), None

    def _cover(self, req: Request, positions: int) -> int:
        """Free blocks (no reservation, no preemption) towards `positions`; the positions covered."""
        blocks, bs = self.kv.blocks, self._limits.block_size
        while len(req.blocks) * bs < positions and blocks.num_free:
            req.add_blocks(blocks.allocate(1))
        return min(positions, len(req.blocks) * bs)

    def _retire(self, req: Request, reason: FinishReason, *, error: str | None = None,
                out: RowOutput | Draw | None = None) -> Event:
        if req.state is RequestState.WAITING:
            self._waiting.remove(req)
        else:
            self._release(req)
        del self._live[req.id]
        self._prefix.forget(req)
        if self._spec is not None:
            self._spec.forget(req.id)
        req.state, req.finish_reason, req.error = RequestState.FINISHED, reason, error
        return Event.of(req, reason, error, out)

    def _release(self, req: Request) -> None:
        """Give back an admitted request's blocks, reservation and slot."""
        self._running.remove(req)
        self._rotation.discard(req.id)
        self.kv.blocks.free(reversed(req.take_blocks()))  # a prefix's tail goes idle first, so is evicted first
        if req.sent_blocks is not None:
            self._forget.append(req.id)
            req.sent_blocks, req.unsent_drop = None, 0
        self._reservations.pop(req.id).release()
        self._prefix.released(req)
        if req.state_slot is not None:
            self.kv.slots.release(req.state_slot)
            req.state_slot = None

    def _preempt(self, req: Request) -> None:
        """Recompute later: keep the outputs, forget the cache, wait at the head of the queue."""
        self._release(req)
        req.num_computed_tokens = 0
        req.state = RequestState.WAITING
        req.preemptions += 1
        self._preemptions += 1
        self._waiting.appendleft(req)

    def _next_block(self, req: Request) -> BlockHandle | None:
        reservation = self._reservations[req.id]
        if reservation.remaining:
            return reservation.take()
        if self.kv.blocks.num_free:
            return self.kv.blocks.allocate(1)[0]
        return None

    def _grow_decoders(self) -> list[Request]:
        """Decoders (oldest first) get the block for their next position, preempting the newest
        admitted request when the pool is dry; returns the decoders that stay."""
        decoders = []
        for req in [r for r in self._running if r.state is RequestState.DECODE]:
            if req.state is not RequestState.DECODE:    # preempted for an older decoder
                continue
            needed = self._blocks_for(req.num_computed_tokens + 1)
            while len(req.blocks) < needed:
                handle = self._next_block(req)
                if handle is None:
                    victim = self._running[-1]
                    self._preempt(victim)
                    if victim is req:
                        break
                else:
                    req.add_blocks((handle,))
            if req.state is RequestState.DECODE:
                decoders.append(req)
        return decoders

    def _admit(self) -> None:
        """Strict FIFO: a head that does not fit, or waits for blocks of its prompt that another request
        is computing, blocks the rest. It takes its cached blocks and reserves the rest of its tokens plus one block."""
        lim = self._limits
        for req in list(self._waiting):
            if req.pause_requested:
                continue
            if self._prompt_pending(req.after) or len(self._running) >= lim.max_rows:
                return
            hit, restore = self._prefix.lookup(req)
            if self._prefix.computing(req, len(hit), self._running, lim.max_prefill_tokens_per_row):
                return
            claim = self.kv.claim(hit, self._blocks_for(len(req.all_token_ids)) - len(hit) + 1, restore)
            if claim is None:
                return
            self._waiting.remove(req)
            req.add_blocks(claim.shared)
            req.num_computed_tokens = len(hit) * lim.block_size
            self._reservations[req.id] = claim.reservation
            req.state_slot = claim.slot
            self._prefix.admitted(req, hit, restore, claim.state_op)
            req.state = RequestState.PREFILL
            self._running.append(req)
            self._rotation.add(req.id)

    def _prompt_pending(self, request_id: str | None) -> bool:
        """A live request whose prompt is not computed yet: who follows it waits, so as to start
        from its cached blocks instead of computing the same prompt alongside it."""
        req = self._live.get(request_id) if request_id is not None else None
        return (req is not None and self._prefix.cache is not None
                and req.state in (RequestState.WAITING, RequestState.PREFILL))

    def _row(self, req: Request, kind: RowKind, count: int, draft: Proposal = ()) -> PlanRow:
        """`count` of the request's tokens to feed, then the proposals `draft` or as many as it
        asks of the engine's draft model (already covered by blocks)."""
        all_ids, start = req.all_token_ids, req.num_computed_tokens
        end = start + count
        need = self._blocks_for(end)
        if len(req.blocks) < need:      # prefill: its reservation covers the prompt
            req.add_blocks([self._reservations[req.id].take() for _ in range(need - len(req.blocks))])
        fresh, sent = req.sent_blocks is None, req.sent_blocks or 0
        req.sent_blocks, drop, req.unsent_drop = len(req.block_ids), req.unsent_drop, 0
        sample = end == len(all_ids)
        params = req.params
        tokens, asked = ((), draft) if isinstance(draft, int) else (draft, 0)
        return PlanRow(
            request_id=req.id, kind=kind, token_ids=tuple(all_ids[start:end]) + tokens, start_pos=start,
            new_blocks=tuple(req.block_ids[sent:]), state_slot=req.state_slot, sample=sample,
            sampling=params, fresh=fresh, sample_index=len(req.output_token_ids),
            num_prompt_tokens=len(req.prompt_token_ids),
            cached_token_ids=tuple(all_ids[:start]) if fresh and (params.penalized or self._draft_reads) else (),
            banned_token_ids=(req.stop_token_ids
                              if sample and len(req.output_token_ids) < params.min_tokens else ()),
            allowed=req.matcher.mask() if sample and req.matcher is not None else None,
            num_draft=len(tokens), drop_blocks=drop, draft_k=asked)
