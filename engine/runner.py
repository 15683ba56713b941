"""The SeqEngine for our torch models: StepPlan -> flat batch tensors -> one forward -> StepResult.

The batch persists between steps: each live request owns a row of a preallocated block-table buffer
(engine/plan_ledger.py assigns it), written only where a plan appends blocks, and a penalised request
keeps running token counts instead of shipping its history. Per-step host work grows with the rows
and tokens of the step, not with how long the requests have run.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.contracts import (PENDING, Draw, EngineLimits, Launched, PlanRow, Ready, RowOutput, StateOp, StepPlan,
                              StepResult)
from engine.debug_hooks import check_step
from engine.models.batch import ForwardBatch, on_device
from engine.plan_ledger import PlanLedger, RowRecord
from engine.sampling import Draws, TokenCounts, draw
from engine.state_rollback import StateRollback


CPU_VERIFY_TOTAL = 8


@dataclass(frozen=True)
class PrefillBudget:
    """Prefill tokens per step. Idle steps take big chunks (GEMM efficiency); steps with decoders take
    about what the weight stream already pays for, so decoders' inter-token latency stays flat.
    Decode rows and their proposals together get the same "free" capacity (`verify_total`)."""
    idle_total: int
    mixed_total: int
    quantum: int
    verify_total: int = 0           # 0: no proposals are verified

    @classmethod
    def for_device(cls, device: torch.device, dtype: torch.dtype) -> "PrefillBudget":
        if device.type == "cuda":
            return cls(idle_total=8192, mixed_total=2048, quantum=512, verify_total=2048)
        # measured on Zen4 CPUs: ~34 GB/s memory, ~420 GFLOP/s bf16 GEMM (~190 fp32); slower CPUs
        # have a lower balance, and the 16-token floor below covers them
        flops = 420e9 if dtype == torch.bfloat16 else 190e9
        balance = flops / 34e9            # tokens one weight pass can carry "for free"
        mixed = max(16, int(round(balance / 16)) * 16)
        # a verify token costs the quantized CPU kernels more than a prefill token in a mixed step:
        # 8 decoders sharing 8 proposal tokens lost aggregate throughput, so on CPUs proposals fill
        # only what 8 rows leave (none once 8 rows decode)
        return cls(idle_total=512, mixed_total=mixed, quantum=64, verify_total=CPU_VERIFY_TOTAL)


class ModelRunner:
    def __init__(self, model, pool, *, max_rows: int, max_model_len: int,
                 budget: PrefillBudget, seed: int | None = None, state_pool=None,
                 compile: bool = False, fullgraph: bool = False, graphs=None, draft=None):
        self.model = model
        self.draft = draft      # engine.draft.DraftModel (speculative = "draft"), else None
        self._compiled = self._compile(model, fullgraph) if compile else None
        # engine.cuda_graphs.DecodeGraphs over the same forward, or None: decode-only steps replay from it
        self.graphs = graphs(self._compiled or model.forward) if graphs else None
        self.pool = pool
        self.state_pool = state_pool      # engine.kv.pool.StatePool for hybrid models, else None
        self.rollback = StateRollback(state_pool, budget.verify_total + max_rows)   # hybrid verify rows
        self.max_rows = max_rows
        self.max_model_len = max_model_len
        self.budget = budget
        self.device = model.device
        self.generator = torch.Generator(device=self.device)
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(seed)
        self.ledger = PlanLedger(max_rows)
        bs = pool.shape.block_size
        # on the device: a step sends only the block ids its plan appends
        self._tables = torch.zeros((max_rows, -(-max_model_len // bs) + 1), dtype=torch.int32,
                                   device=self.device)
        self._counts: dict[str, TokenCounts] = {}     # penalised requests' token counts
        # the last step's first draw per sampling row (on the device), and each request's index there
        self._drawn: tuple[torch.Tensor | None, dict[str, int]] = (None, {})

    @staticmethod
    def _compile(model, fullgraph: bool):
        if model.device.type == "cuda":   # the Triton kernels become graph nodes inductor fuses around
            from ops.triton import expose_to_inductor
            expose_to_inductor()
        # dynamic: one graph for every batch size and chunk length instead of a recompile each
        return torch.compile(model.forward, dynamic=True, fullgraph=fullgraph)

    def _forward(self, batch: ForwardBatch, rows: list[PlanRow]) -> torch.Tensor:
        external = (self.pool.layers,) if self.state_pool is None else (self.pool.layers, self.state_pool.layers)
        slots = None if self.state_pool is None else on_device(
            [-1 if r.state_slot is None else r.state_slot for r in rows], self.device, torch.int32)
        hidden = None if self.graphs is None else self.graphs.run(batch, *external, state_slots=slots)
        if hidden is None:      # not a decode-only step (or no graphs): eager / compiled
            forward = self._compiled or self.model.forward
            hidden = forward(batch, *external) if slots is None else forward(batch, *external, slots)
        return hidden

    def limits(self) -> EngineLimits:
        idle = self.budget.idle_total
        return EngineLimits(
            max_rows=self.max_rows, block_size=self.pool.shape.block_size,
            num_blocks=self.pool.num_blocks, num_state_slots=self.state_pool.num_slots if self.state_pool else 0,
            max_model_len=self.max_model_len,
            max_prefill_rows=self.max_rows, max_prefill_tokens_per_row=idle,
            max_prefill_tokens_total=idle, prefill_quantum=min(self.budget.quantum, idle),
            mixed_prefill_tokens_total=self.budget.mixed_total,
            max_verify_tokens_total=self.budget.verify_total)

    def _state_op(self, op: StateOp) -> None:
        """Zero a recurrent-state slot before a request uses it, or copy every linear-attention
        layer's conv and SSM state from one slot to another (prefix-cache checkpoints)."""
        if self.state_pool is None:
            raise ValueError("this model keeps no recurrent state: a plan named state slot "
                             f"{op.dst}")
        if op.src is None:
            self.state_pool.reset(op.dst)
        else:
            self.state_pool.copy(op.src, op.dst)

    def _row_error(self, row: PlanRow, rec: RowRecord, drawn: dict[str, int]) -> str | None:
        vocab = self.model.cfg.vocab_size
        pending = row.token_ids[-1] == PENDING
        if pending and row.request_id not in drawn:
            return "its last token is PENDING, and the step before drew no token for it"
        bad = [t for t in (row.token_ids[:-1] if pending else row.token_ids) if not 0 <= t < vocab]
        if bad:
            return f"token id {bad[0]} is outside the vocabulary (0..{vocab - 1})"
        if row.sampling is not None and row.sampling.logit_bias and row.sampling.logit_bias[-1][0] >= vocab:
            return f"logit_bias names token id {row.sampling.logit_bias[-1][0]}, outside the vocabulary (0..{vocab - 1})"
        if row.draft_k and self.draft is None:
            return "the row asks for draft proposals, but this engine has no draft model"
        if row.end_pos > self.max_model_len:
            return f"position {row.end_pos} is past max_model_len {self.max_model_len}"
        if len(rec.block_table) * self.pool.shape.block_size < row.end_pos:
            return f"block table covers {len(rec.block_table)} blocks, too few for {row.end_pos} tokens"
        return None

    def _update(self, plan: StepPlan, records: list[RowRecord]) -> None:
        """Write the plan's appended block ids into the persistent tables; fresh rows restart
        their token counts."""
        for row, rec in zip(plan.rows, records):
            if row.fresh:
                self._counts.pop(row.request_id, None)
            if row.new_blocks:
                end = len(rec.block_table)
                self._tables[rec.index, end - len(row.new_blocks):end] = on_device(
                    row.new_blocks, self.device, torch.int32)

    def _count(self, row: PlanRow, fed: torch.Tensor) -> TokenCounts:
        """A penalised row's counts, with this row's fed tokens (`fed`, PENDING resolved) added: the
        same tokens as the prompt + output so far at its draw."""
        counts = self._counts.get(row.request_id)
        if counts is None:
            counts = self._counts[row.request_id] = TokenCounts.zeros(self.model.cfg.vocab_size, self.device)
        if row.cached_token_ids:
            counts.add(row.cached_token_ids, row.num_prompt_tokens)
        counts.add(fed, max(0, row.num_prompt_tokens - row.start_pos))
        return counts

    def _batch(self, rows: list[PlanRow], records: list[RowRecord],
               before: tuple[torch.Tensor | None, dict[str, int]] = (None, {})) -> ForwardBatch:
        """The flat batch of `rows`; a PENDING last token is read on the device from the draws of the
        step `before`. The indices are built on the host from the records' block tables, with list
        operations per row and block, and go to the device in two copies: on a CPU one small tensor
        op costs more than a row's list work."""
        dev, bs = self.device, self.pool.shape.block_size
        ids, positions, slots, drawn, pending, starts, ends = [], [], [], [], [], [0], []
        for r, rec in zip(rows, records):
            start = r.start_pos
            end = start + len(r.token_ids)
            ids += r.token_ids
            positions += range(start, end)
            table = rec.block_table
            for b in range(start // bs, -(-end // bs)):
                base = (table[b] - b) * bs
                slots += range(base + max(start, b * bs), base + min(end, (b + 1) * bs))
            at = starts[-1] + end - start       # the row's end in the flat batch
            if r.sample:        # the drawn positions: the last token, a verify row's last 1 + num_draft
                drawn += range(at - 1 - r.num_draft, at)
            if r.token_ids[-1] == PENDING:
                pending += [at - 1, before[1][r.request_id]]
            starts.append(at)
            ends.append(end)
        n, s = len(ids), len(drawn)
        flat = on_device(ids + positions + slots + drawn + [rec.index for rec in records] + pending, dev)
        lens = on_device(starts + ends, dev, torch.int32)
        input_ids, index = flat[:n], flat[3 * n + s:3 * n + s + len(rows)]
        if pending:
            at, src = flat[3 * n + s + len(rows):].view(-1, 2).unbind(1)
            input_ids[at] = before[0][src]
        width = -(-max(ends) // bs)
        return ForwardBatch(
            input_ids=input_ids, positions=flat[n:2 * n], slot_mapping=flat[2 * n:3 * n],
            block_tables=self._tables[:, :width].index_select(0, index),
            query_start_loc=lens[:len(starts)], context_lens=lens[len(starts):],
            logits_indices=flat[3 * n:3 * n + s])

    def execute(self, plan: StepPlan) -> StepResult:
        return self.launch(plan).result()

    def launch(self, plan: StepPlan) -> Launched:
        """Run the step up to its draws, which stay on the device until the result is read: the next
        plan's PENDING tokens are taken from them there (overlapped scheduling)."""
        closed, records = self.ledger.begin(plan)      # a broken delta raises ContractError
        for rec in closed:
            self._counts.pop(rec.request_id, None)
            if self.draft is not None:
                self.draft.forget(rec.request_id)
        self._update(plan, records)
        drawn, self._drawn = self._drawn, (None, {})
        errors = {r.request_id: self._row_error(r, rec, drawn[1]) for r, rec in zip(plan.rows, records)}
        ok = [(r, rec) for r, rec in zip(plan.rows, records) if errors[r.request_id] is None]
        step = _Launched(self, plan, errors, [rec for _, rec in ok])
        try:
            check_step(plan.step)     # debug hook: raises in the steps PAGEDSERVE_DEBUG_FAIL_STEPS lists
            with torch.inference_mode():
                for op in plan.state_ops:
                    self._state_op(op)
                if ok:
                    rows = [r for r, _ in ok]
                    if self.draft is not None:      # draft_k rows become verify rows
                        rows = self.draft.propose(rows, step.records, self._batch)
                    step.fed = {r.request_id: r for r in rows}
                    batch = self._batch(rows, step.records, drawn)
                    counts, at = {}, 0
                    for r in rows:
                        if r.sampling.penalized:
                            counts[r.request_id] = self._count(r, batch.input_ids[at:at + len(r.token_ids)])
                        at += len(r.token_ids)
                    self.rollback.prepare(batch, rows)
                    hidden = self._forward(batch, rows)
                    sampling_rows = [r for r in rows if r.sample]
                    if sampling_rows:
                        step.draws = draw(self.model.logits(hidden), sampling_rows, self.generator,
                                          [counts.get(r.request_id) for r in sampling_rows])
                        self._drawn = (step.draws.firsts(), {r.request_id: i for i, r in enumerate(sampling_rows)})
                        if self.rollback.recording:     # hybrid verify rows: the state must be right
                            self.rollback.apply(step.read())    # before the next step runs
        except Exception as e:  # noqa: BLE001 - a step failure is reported, the engine lives on
            self._drawn = (None, {})
            return Ready(StepResult(plan.step, error=f"{type(e).__name__}: {e}"))
        finally:
            self.ledger.commit(plan, records)
        return step


@dataclass
class _Launched:
    """A step launched by ModelRunner.launch; `result()` reads its draws back and answers the plan."""
    runner: ModelRunner
    plan: StepPlan
    errors: dict[str, str | None]
    records: list[RowRecord]
    fed: dict[str, PlanRow] = field(default_factory=dict)   # the rows as run (with draft proposals)
    draws: Draws | None = None
    _host: dict[str, list[tuple]] | None = None

    def read(self) -> dict[str, list[tuple]]:
        """Each sampling row's draws on the host, by request id."""
        if self._host is None:
            self._host = {} if self.draws is None else dict(
                zip([r.request_id for r in self.draws.rows], self.draws.host()))
        return self._host

    def result(self) -> StepResult:
        try:
            sampled = self.read()
        except Exception as e:  # noqa: BLE001 - a device error surfaces when the draws are read
            return StepResult(self.plan.step, error=f"{type(e).__name__}: {e}")
        outputs = []
        for r in self.plan.rows:
            if self.errors[r.request_id]:
                outputs.append(RowOutput(r.request_id, error=self.errors[r.request_id]))
            elif r.request_id in sampled:
                (tok, lp, top), *verify = sampled[r.request_id]
                proposals = self.fed[r.request_id].token_ids[1:] if r.draft_k else ()
                outputs.append(RowOutput(r.request_id, token=tok, logprob=lp, top_logprobs=top,
                                         verify=tuple(Draw(*d) for d in verify), proposals=proposals))
            else:
                outputs.append(RowOutput(r.request_id))
        if self.runner.draft is not None:
            self.runner.draft.seen(list(self.fed.values()), self.records, {o.request_id: o for o in outputs})
        return StepResult(self.plan.step, tuple(outputs))
