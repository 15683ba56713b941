"""Speculative decoding on the scheduler's side: which decoders get proposals and how many, and
which of a verify row's draws a request keeps. No torch here.

A decoder with proposals p1..pk becomes one verify row (last token, p1..pk); the engine draws a
token after each of its k + 1 positions. The request keeps the draws up to and including the first
that differs from the proposal it follows — a correction, or after k matches the bonus draw — so
every step adds at least one token. Greedy rows draw the argmax, so this is exact greedy decoding.
For random draws it is the rejection rule for a point-mass proposal: a draw from p_target equals
the proposal x with probability p_target(x) (accepted), and otherwise is distributed as p_target
with x removed and renormalised (the correction); a seeded row's draws depend on (seed, token
index) only, so its output is the same with or without speculation.

Requests whose next draws depend on state the scheduler would have to roll back get no proposals:
penalties (running token counts), grammars (the matcher) and min_tokens bans (per position). A lazy
grammar that has not begun is no such state while no proposal holds its trigger: proposals are cut
before it, so a trigger can only be a run's last draw (the engine's draft model, whose proposals
the scheduler does not see, makes none for such requests). Hybrid
models' recurrent state rolls back in the engine: it records the state after each of a verify row's
tokens and keeps the one after the accepted run, which `accepted_run` decides on both sides
(engine/state_rollback.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

from engine.contracts import Draw, PlanRow, RowOutput
from engine.request import Request

MAX_BACKOFF = 64        # steps a request sits out, at most, before it proposes again


# Proposals for one decoder: the tokens themselves, or how many the engine's draft model is to make
Proposal = tuple[int, ...] | int


class Proposer(Protocol):
    def propose(self, req: Request, k: int) -> Proposal: ...
    def forget(self, request_id: str) -> None: ...


class DraftProposer:
    """Proposals made by the engine's draft model, in the step that verifies them: the scheduler
    only asks for k of them (and covers their positions with blocks)."""

    def propose(self, req: Request, k: int) -> int:
        return k

    def forget(self, request_id: str) -> None:
        pass


@dataclass
class _Pace:
    """One request's proposal length: +1 after a fully accepted run, cut to one more than was accepted
    otherwise; at 0 it sits out `wait` steps, twice as many each time in a row, then tries k = 1."""
    k: int
    wait: int = 0
    backoff: int = 1


def accepted_run(row: PlanRow, out: RowOutput) -> list[RowOutput | Draw]:
    """The draws a verify row keeps: each draw that equals the proposal after it, then one more."""
    draws = [out, *out.verify]
    proposals = row.token_ids[len(row.token_ids) - row.num_draft:]
    kept = 1
    while kept < len(draws) and draws[kept - 1].token == proposals[kept - 1]:
        kept += 1
    return draws[:kept]


class Speculator:
    """Each step's proposals, each request's pace, and the counters the stats report."""

    def __init__(self, proposer: Proposer, k: int) -> None:
        self.proposer = proposer
        self.k = k
        self._paces: dict[str, _Pace] = {}
        self._turn = 0
        self.proposed = self.accepted = self.verify_rows = 0

    @property
    def engine_drafts(self) -> bool:
        """The engine's draft model makes the proposals (and reads each fresh row's cached prefix)."""
        return isinstance(self.proposer, DraftProposer)

    def eligible(self, req: Request) -> bool:
        """No state of the request would have to roll back (see the module docstring)."""
        p = req.params
        free = req.matcher is None or (req.matcher.dormant and not self.engine_drafts)
        return not p.penalized and free and len(req.output_token_ids) >= p.min_tokens

    def plan(self, decoders: list[Request], budget: int,
             cover: Callable[[Request, int], int]) -> dict[str, Proposal]:
        """Proposals for this step's decoders within `budget` tokens, in a rotating order so a
        tight budget is shared; `cover(req, positions)` grows the request's blocks towards
        `positions` without preempting anyone and returns the positions covered."""
        drafts: dict[str, Proposal] = {}
        start = self._turn % len(decoders) if decoders else 0
        self._turn += 1
        for req in decoders[start:] + decoders[:start]:
            if budget <= 0:
                break
            draft = self._draft(req, budget)
            wanted = draft if isinstance(draft, int) else len(draft)
            if wanted:
                fed = req.num_computed_tokens + 1
                n = min(wanted, cover(req, fed + wanted) - fed)
                if n > 0:
                    drafts[req.id] = n if isinstance(draft, int) else draft[:n]
                    budget -= n
        return drafts

    def _draft(self, req: Request, budget: int) -> Proposal:
        if not self.eligible(req):
            return ()
        pace = self._paces.setdefault(req.id, _Pace(self.k))
        if pace.k == 0:
            if pace.wait > 0:
                pace.wait -= 1
                return ()
            pace.k = 1
        # the last draw of a run is always kept: proposals past max_tokens could only be wasted
        k = min(pace.k, budget, req.max_tokens - len(req.output_token_ids) - 1)
        proposal = self.proposer.propose(req, k) if k > 0 else ()
        return req.matcher.before_trigger(proposal) if req.matcher is not None else proposal

    def accept(self, row: PlanRow, out: RowOutput) -> list[RowOutput | Draw]:
        """The draws `row` keeps; counts them and adapts the request's proposal length."""
        run = accepted_run(row, out)
        matched = len(run) - 1
        self.proposed += row.num_draft
        self.accepted += matched
        self.verify_rows += 1
        pace = self._paces[row.request_id]
        if matched == row.num_draft:
            pace.k, pace.backoff = min(self.k, pace.k + 1), 1
        elif matched:
            pace.k, pace.backoff = min(self.k, matched + 1), 1
        else:
            pace.k, pace.wait, pace.backoff = 0, pace.backoff, min(MAX_BACKOFF, 2 * pace.backoff)
        return run

    def forget(self, request_id: str) -> None:
        self._paces.pop(request_id, None)
        self.proposer.forget(request_id)

    def stats(self) -> dict:
        """The speculation fields of SchedulerStats."""
        return dict(spec_proposed_tokens_total=self.proposed, spec_accepted_tokens_total=self.accepted,
                    spec_verify_rows_total=self.verify_rows)
