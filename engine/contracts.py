"""The contracts between the scheduler and a sequence engine (docs/architecture.md). No torch here.

The scheduler builds a StepPlan, the engine answers it with a StepResult of the same number;
`check_result` is the single place that decides whether a result may be applied to its plan.
Plans are deltas: a request's first row after admission carries its whole block table (`fresh`),
later rows only the blocks appended since; the engine keeps the rest (engine/plan_ledger.py).
Everything the engine does to its state happens inside a numbered plan: forgotten requests and
state-slot operations come first, then the rows.
A verify row (speculative decoding) is a decode row that also feeds proposed tokens: the engine
draws after each, the scheduler keeps the draws up to the first that differs from its proposal,
and the next row starts after them, dropping the table's blocks the rejected positions needed.
With a draft model the engine makes the proposals itself: the row asks for `draft_k` of them,
and the output names the tokens proposed next to the draws that verified them.
With overlapped scheduling the scheduler plans step N+1 before N's draws are known: a row whose last
token is N's draw for that request feeds PENDING in its place, which the engine resolves
from the draws it still holds (on the device), and `launch` starts a step whose result is read later.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, replace
from typing import Protocol

from engine.request import SamplingParams


PENDING = -1    # a sampling row's last token: the one the engine drew for this request in the plan just before


class ContractError(RuntimeError):
    """A plan or a result breaks the contract; the engine or the scheduler has a bug."""


class RowKind(str, enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"


@dataclass(frozen=True)
class EngineLimits:
    max_rows: int                   # max concurrency (rows in one step)
    block_size: int
    num_blocks: int
    num_state_slots: int            # 0 for attention-only models
    max_model_len: int
    max_prefill_rows: int
    max_prefill_tokens_per_row: int
    max_prefill_tokens_total: int   # prefill tokens in a step without decode rows
    prefill_quantum: int
    mixed_prefill_tokens_total: int | None = None   # ... and in one with decode rows (None: the same)
    max_verify_tokens_total: int = 0    # decode-row tokens a step carries at about the cost of one
                                        # token per row (0: the engine verifies no proposals)

    def prefill_tokens_total(self, decode_rows: int) -> int:
        if decode_rows and self.mixed_prefill_tokens_total is not None:
            return self.mixed_prefill_tokens_total
        return self.max_prefill_tokens_total

    def verify_tokens(self, decode_rows: int) -> int:
        """Proposal tokens a step with `decode_rows` decode rows can carry: what the rows' own
        tokens leave of the verify capacity."""
        return max(0, self.max_verify_tokens_total - decode_rows)


@dataclass(frozen=True)
class PlanRow:
    request_id: str
    kind: RowKind
    token_ids: tuple[int, ...]      # exact tokens to feed, positions start_pos, start_pos+1, ...
    start_pos: int
    new_blocks: tuple[int, ...]     # block ids appended to the request's table for this row; with
                                    # the earlier ones they cover start_pos + len(token_ids) positions
    state_slot: int | None          # recurrent-state slot (hybrid models), else None
    sample: bool                    # sample a token after the last fed token (a verify row:
                                    # after each of its last 1 + num_draft tokens)
    sampling: SamplingParams | None = None   # the request's params (set on every row)
    fresh: bool = False             # first row since admission: new_blocks is the whole table and
                                    # start_pos the cached prefix; the engine starts a new record
    sample_index: int = 0           # tokens this request generated so far: seeds this draw
    num_prompt_tokens: int = 0      # positions below this are prompt (repetition vs presence)
    cached_token_ids: tuple[int, ...] = ()  # fresh rows of penalised requests (with a draft model,
                                            # all): the tokens before start_pos (a cached prefix),
                                            # counted or read by the draft, never fed
    banned_token_ids: tuple[int, ...] = ()  # masked for this draw (EOS/stop ids before min_tokens)
    allowed: bytes | None = None    # the request's grammar: bit i of the little-endian 32-bit
                                    # words set = token i may be drawn (None: every token may)
    num_draft: int = 0              # a verify row: its last num_draft tokens are proposals
    drop_blocks: int = 0            # blocks removed from the end of the table before new_blocks
                                    # are appended (the tail past a verify row's accepted tokens)
    draft_k: int = 0                # a verify row whose proposals, up to draft_k, the engine's draft
                                    # model makes and appends to token_ids (new_blocks cover draft_k)

    def with_proposals(self, proposals: tuple[int, ...]) -> "PlanRow":
        """A draft_k row as the verify row it became once the draft model proposed `proposals`."""
        return replace(self, token_ids=self.token_ids + proposals, num_draft=len(proposals), draft_k=0)

    @property
    def num_proposed(self) -> int:
        return self.num_draft + self.draft_k

    @property
    def end_pos(self) -> int:
        """The position after the row's last fed token, proposals included."""
        return self.start_pos + len(self.token_ids) + self.draft_k


@dataclass(frozen=True)
class StateOp:
    """A recurrent-state slot operation, run before the plan's rows: reset `dst`, or copy `src`
    into `dst` (prefix-cache checkpoints of hybrid models)."""
    dst: int
    src: int | None = None          # None: reset


@dataclass(frozen=True)
class StepPlan:
    step: int
    rows: tuple[PlanRow, ...]
    forget: tuple[str, ...] = ()            # requests retired or preempted since the last plan
    state_ops: tuple[StateOp, ...] = ()


@dataclass(frozen=True)
class Draw:
    """A token drawn after one proposal of a verify row (with its logprobs if asked)."""
    token: int
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class RowOutput:
    request_id: str
    token: int | None = None        # drawn after the last fed token (a verify row: after the
                                    # token before its proposals)
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()
    error: str | None = None
    verify: tuple[Draw, ...] = ()   # a verify row: one draw after each proposal, in order
    proposals: tuple[int, ...] = ()     # a draft_k row: the tokens the draft model proposed (it may
                                        # propose fewer than asked, or none)


@dataclass(frozen=True)
class StepResult:
    step: int
    rows: tuple[RowOutput, ...] = ()
    error: str | None = None        # a step-level failure: every live request fails, no rows


class Launched(Protocol):
    def result(self) -> StepResult: ...


@dataclass(frozen=True)
class Ready:
    """A launched step whose result is already known (a synchronous engine, a failed launch)."""
    value: StepResult

    def result(self) -> StepResult:
        return self.value


class SeqEngine(Protocol):
    def limits(self) -> EngineLimits: ...
    def execute(self, plan: StepPlan) -> StepResult: ...
    # start a step and return at once; its result is read later (the next plan may be launched first)
    def launch(self, plan: StepPlan) -> Launched: ...


def check_plan(plan: StepPlan, running_decoders: set[str] | frozenset[str] = frozenset()) -> None:
    """Rows unique and non-empty; every running decoder appears exactly once as a decode row."""
    seen: set[str] = set()
    for row in plan.rows:
        if row.request_id in seen:
            raise ContractError(f"step {plan.step}: request {row.request_id} appears twice")
        seen.add(row.request_id)
        if not row.token_ids:
            raise ContractError(f"step {plan.step}: row {row.request_id} feeds no tokens")
        if row.kind is RowKind.DECODE and len(row.token_ids) != 1 + row.num_draft:
            raise ContractError(f"step {plan.step}: decode row {row.request_id} feeds "
                                f"{len(row.token_ids)} tokens for {row.num_draft} proposals")
        if row.draft_k and row.num_draft:
            raise ContractError(f"step {plan.step}: row {row.request_id} carries proposals and asks "
                                "the engine for more")
        if row.num_proposed and (row.kind is not RowKind.DECODE or not row.sample):
            raise ContractError(f"step {plan.step}: row {row.request_id} carries proposals but is "
                                "not a sampling decode row")
        if row.drop_blocks and row.fresh:
            raise ContractError(f"step {plan.step}: fresh row {row.request_id} drops blocks")
        if row.sample and row.sampling is None:
            raise ContractError(f"step {plan.step}: row {row.request_id} samples without params")
        if PENDING in row.token_ids[:-1] or (row.token_ids[-1] == PENDING and not row.sample):
            raise ContractError(f"step {plan.step}: row {row.request_id} feeds PENDING other than as a "
                                "sampling row's last token")
        if row.request_id in plan.forget and not row.fresh:
            raise ContractError(f"step {plan.step}: row {row.request_id} is forgotten but not fresh")
    decoders = {r.request_id for r in plan.rows if r.kind is RowKind.DECODE}
    missing = set(running_decoders) - decoders
    if missing:
        raise ContractError(f"step {plan.step}: running decoders missing: {sorted(missing)}")


def check_result(plan: StepPlan, result: StepResult) -> None:
    """One output per row in plan order, tokens only where sampling was asked, errors without tokens."""
    if result.step != plan.step:
        raise ContractError(f"result for step {result.step} answers plan {plan.step}")
    if result.error is not None:
        if result.rows:
            raise ContractError(f"step {plan.step}: a step error carries {len(result.rows)} rows")
        return
    if len(result.rows) != len(plan.rows):
        raise ContractError(f"step {plan.step}: {len(result.rows)} outputs for {len(plan.rows)} rows")
    for row, out in zip(plan.rows, result.rows):
        if out.request_id != row.request_id:
            raise ContractError(f"step {plan.step}: output for {out.request_id} where "
                                f"{row.request_id} was planned")
        if out.error is not None:
            if out.token is not None:
                raise ContractError(f"step {plan.step}: failed row {row.request_id} has a token")
        elif row.sample and out.token is None:
            raise ContractError(f"step {plan.step}: sampling row {row.request_id} got no token")
        elif not row.sample and out.token is not None:
            raise ContractError(f"step {plan.step}: non-sampling row {row.request_id} got a token")
        if len(out.proposals) > (row.draft_k if out.token is not None else 0):
            raise ContractError(f"step {plan.step}: row {row.request_id} got {len(out.proposals)} "
                                f"draft proposals for {row.draft_k} asked")
        want = (len(out.proposals) if row.draft_k else row.num_draft) if out.token is not None else 0
        if len(out.verify) != want:
            raise ContractError(f"step {plan.step}: row {row.request_id} got {len(out.verify)} "
                                f"draws after proposals for {want}")
