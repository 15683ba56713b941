"""Overlapped scheduling: step N+1 is planned and launched before step N's result is read. No torch here.

On a GPU the host would otherwise wait for every step's tokens before planning the next, leaving the
device idle for the planning time. Here the plan in flight is first applied as if each sampling row drew
one token, PENDING (engine/contracts.py), so the next plan feeds PENDING where that token goes and the
engine resolves it from the draws it holds; then the first step's result is read and settled: each
PENDING output becomes its token, and a stop id there ends the request, whose row in the step already
launched is dead (its output is dropped, its blocks go back as usual).

Decisions are the synchronous scheduler's but for that one dead row: whatever a step's draws cannot
change (lengths, blocks, admissions, preemptions) is known when it is planned. A plan whose draws do
decide the next one (proposals to accept, a grammar's next mask) is read before the next is planned.
"""
from __future__ import annotations

from engine.contracts import PENDING, ContractError, Launched, RowOutput, StepPlan, StepResult, check_result
from engine.request import Event, FinishReason, Request, RequestState
from engine.scheduler import Scheduler


class OverlapScheduler(Scheduler):
    overlapped = True

    def __init__(self, engine, **kw) -> None:
        if kw.get("speculator") is not None:
            raise ValueError("overlapped scheduling plans a step before the tokens of the one before are "
                             "known, and speculative decoding proposes from them: turn one of them off")
        super().__init__(engine, **kw)
        # the step launched last, its result unread
        self._ahead: tuple[StepPlan, Launched] | None = None

    @property
    def has_work(self) -> bool:
        return super().has_work or self.in_flight

    @property
    def in_flight(self) -> bool:
        return self._ahead is not None

    def step(self) -> list[Event]:
        events, self._pending = self._pending, []
        ahead, self._ahead, assumed = self._ahead, None, []
        if ahead is not None and not self._assumable(ahead[0]):
            events, ahead = events + self._apply_checked(ahead[0], ahead[1].result()), None
        if ahead is not None:
            planned = dict(self._planned)
            drawn = StepResult(ahead[0].step, tuple(RowOutput(r.request_id, token=PENDING if r.sample else None)
                                                    for r in ahead[0].rows))
            assumed = [(planned[e.request_id], e.finished) for e in self.apply(ahead[0], drawn)]
        plan = self.schedule()
        if plan is not None:
            self._ahead = (plan, self._launch(plan))
        if ahead is not None:
            events += self._settle(ahead[0], assumed, ahead[1].result())
        return events

    def _start(self, plan: StepPlan) -> Launched:
        return self.engine.launch(plan)

    def _assumable(self, plan: StepPlan) -> bool:
        """Whether everything but the drawn tokens is known before the plan's result: no proposals
        to accept, no grammar that must see a token before its next mask."""
        return all(not r.num_proposed and not (r.sample and self._planned[r.request_id].matcher)
                   for r in plan.rows)

    def _settle(self, plan: StepPlan, assumed: list[tuple[Request, FinishReason | None]],
                result: StepResult) -> list[Event]:
        """The result of a plan applied as assumed: its draws in place of PENDING, in row order, each
        ending its request if it is a stop id; a failed row or step fails its requests."""
        try:
            check_result(plan, result)
        except ContractError as exc:
            result = StepResult(plan.step, error=f"engine broke the step contract: {exc}")
        outs = {o.request_id: o for o in result.rows}
        events = []
        for req, assumed_finish in assumed:
            if req.state is RequestState.FINISHED and assumed_finish is None:
                continue                    # cancelled, or stopped by a string, since it was planned
            out = outs.get(req.id)
            if out is None or out.error is not None:
                error = result.error or out.error
                events.append(Event.of(req, FinishReason.ERROR, error) if assumed_finish else
                              self._retire(req, FinishReason.ERROR, error=error))
                continue
            req.set_last_output(out.token)
            self._recorder.token_drawn(req)
            reason = req.finished_by_last_token(self._limits.max_model_len)
            if reason is not None and assumed_finish is None:
                events.append(self._retire(req, reason, out=out))
            else:                           # a length finish was known when it was planned
                events.append(Event.of(req, reason, None, out))
        return events
