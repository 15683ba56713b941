"""The SeqEngine for our torch models: StepPlan -> flat batch tensors -> one forward -> StepResult."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.contracts import EngineLimits, PlanRow, RowOutput, StepPlan, StepResult
from engine.debug_hooks import check_step
from engine.models.batch import ForwardBatch
from engine.sampling import sample


@dataclass(frozen=True)
class PrefillBudget:
    """Prefill tokens per step. Idle steps take big chunks (GEMM efficiency); steps with decoders take
    about what the weight stream already pays for, so decoders' inter-token latency stays flat."""
    idle_total: int
    mixed_total: int
    quantum: int

    @classmethod
    def for_device(cls, device: torch.device, dtype: torch.dtype) -> "PrefillBudget":
        if device.type == "cuda":
            return cls(idle_total=8192, mixed_total=2048, quantum=512)
        # measured on Zen4 CPUs: ~34 GB/s memory, ~420 GFLOP/s bf16 GEMM (~190 fp32); slower CPUs
        # have a lower balance, and the 16-token floor below covers them
        flops = 420e9 if dtype == torch.bfloat16 else 190e9
        balance = flops / 34e9            # tokens one weight pass can carry "for free"
        mixed = max(16, int(round(balance / 16)) * 16)
        return cls(idle_total=512, mixed_total=mixed, quantum=64)


class ModelRunner:
    def __init__(self, model, pool, *, max_rows: int, max_model_len: int,
                 budget: PrefillBudget, seed: int | None = None, state_pool=None,
                 compile: bool = False, fullgraph: bool = False, graphs=None):
        self.model = model
        self._compiled = self._compile(model, fullgraph) if compile else None
        # engine.cuda_graphs.DecodeGraphs over the same forward, or None: decode-only steps replay from it
        self.graphs = graphs(self._compiled or model.forward) if graphs else None
        self.pool = pool
        self.state_pool = state_pool      # engine.kv.pool.StatePool for hybrid models, else None
        self.max_rows = max_rows
        self.max_model_len = max_model_len
        self.budget = budget
        self.device = model.device
        self.generator = torch.Generator(device=self.device)
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(seed)

    @staticmethod
    def _compile(model, fullgraph: bool):
        if model.device.type == "cuda":   # the Triton kernels become graph nodes inductor fuses around
            from ops.triton import expose_to_inductor
            expose_to_inductor()
        # dynamic: one graph for every batch size and chunk length instead of a recompile each
        return torch.compile(model.forward, dynamic=True, fullgraph=fullgraph)

    def _forward(self, batch: ForwardBatch, rows: list[PlanRow]) -> torch.Tensor:
        external = (self.pool.layers,) if self.state_pool is None else (self.pool.layers, self.state_pool.layers)
        slots = None if self.state_pool is None else torch.tensor(
            [-1 if r.state_slot is None else r.state_slot for r in rows], dtype=torch.int32, device=self.device)
        hidden = None if self.graphs is None else self.graphs.run(batch, *external, state_slots=slots)
        if hidden is None:      # not a decode-only step (or no graphs): eager / compiled
            forward = self._compiled or self.model.forward
            hidden = forward(batch, *external) if slots is None else forward(batch, *external, slots)
        return hidden

    def limits(self, decode_rows: int) -> EngineLimits:
        total = self.budget.mixed_total if decode_rows else self.budget.idle_total
        return EngineLimits(
            max_rows=self.max_rows, block_size=self.pool.shape.block_size,
            num_blocks=self.pool.num_blocks, num_state_slots=self.state_pool.num_slots if self.state_pool else 0,
            max_model_len=self.max_model_len,
            max_prefill_rows=self.max_rows, max_prefill_tokens_per_row=total,
            max_prefill_tokens_total=total, prefill_quantum=min(self.budget.quantum, total))

    def reset_state(self, slot: int) -> None:
        """Zero a recurrent-state slot before a request uses it (attention-only models keep none)."""
        if self.state_pool is not None:
            self.state_pool.reset(slot)

    def copy_state(self, src_slot: int, dst_slot: int) -> None:
        """Copy one slot's recurrent state into another (prefix-cache checkpoints)."""
        if self.state_pool is None:
            raise ValueError("this model keeps no recurrent state: there are no state slots to copy")
        self.state_pool.copy(src_slot, dst_slot)

    def _row_error(self, row: PlanRow) -> str | None:
        vocab = self.model.cfg.vocab_size
        bad = [t for t in row.token_ids if not 0 <= t < vocab]
        if bad:
            return f"token id {bad[0]} is outside the vocabulary (0..{vocab - 1})"
        if row.sampling is not None and row.sampling.logit_bias and row.sampling.logit_bias[-1][0] >= vocab:
            return f"logit_bias names token id {row.sampling.logit_bias[-1][0]}, outside the vocabulary (0..{vocab - 1})"
        if row.end_pos > self.max_model_len:
            return f"position {row.end_pos} is past max_model_len {self.max_model_len}"
        if len(row.block_table) * self.pool.shape.block_size < row.end_pos:
            return f"block table covers {len(row.block_table)} blocks, too few for {row.end_pos} tokens"
        return None

    def _batch(self, rows: list[PlanRow]) -> ForwardBatch:
        dev, bs = self.device, self.pool.shape.block_size
        lens = torch.tensor([len(r.token_ids) for r in rows], dtype=torch.int64)
        starts = torch.tensor([r.start_pos for r in rows], dtype=torch.int64)
        width = max(len(r.block_table) for r in rows)
        tables = torch.zeros((len(rows), width), dtype=torch.int32)
        for i, r in enumerate(rows):
            tables[i, :len(r.block_table)] = torch.tensor(r.block_table, dtype=torch.int32)
        row_of = torch.repeat_interleave(torch.arange(len(rows)), lens)
        qsl = torch.zeros(len(rows) + 1, dtype=torch.int64)
        qsl[1:] = lens.cumsum(0)
        positions = starts[row_of] + torch.arange(int(qsl[-1])) - qsl[:-1][row_of]
        slots = tables[row_of, positions // bs].long() * bs + positions % bs
        sampling = [i for i, r in enumerate(rows) if r.sample]
        ids = [t for r in rows for t in r.token_ids]
        return ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.int64, device=dev),
            positions=positions.to(dev), slot_mapping=slots.to(dev),
            block_tables=tables.to(dev), query_start_loc=qsl.to(torch.int32).to(dev),
            context_lens=(starts + lens).to(torch.int32).to(dev),
            logits_indices=(qsl[1:][sampling] - 1).to(dev))

    def execute(self, plan: StepPlan) -> StepResult:
        errors = {r.request_id: self._row_error(r) for r in plan.rows}
        rows = [r for r in plan.rows if errors[r.request_id] is None]
        sampled = {}
        if rows:
            try:
                check_step(plan.step)     # debug hook: raises in the steps PAGEDSERVE_DEBUG_FAIL_STEPS lists
                with torch.inference_mode():
                    hidden = self._forward(self._batch(rows), rows)
                    sampling_rows = [r for r in rows if r.sample]
                    if sampling_rows:
                        picks = sample(self.model.logits(hidden), sampling_rows, self.generator)
                        sampled = {r.request_id: p for r, p in zip(sampling_rows, picks)}
            except Exception as e:  # noqa: BLE001 - a step failure is reported, the engine lives on
                return StepResult(plan.step, error=f"{type(e).__name__}: {e}")
        outputs = []
        for r in plan.rows:
            if errors[r.request_id]:
                outputs.append(RowOutput(r.request_id, error=errors[r.request_id]))
            elif r.request_id in sampled:
                tok, lp, top = sampled[r.request_id]
                outputs.append(RowOutput(r.request_id, token=tok, logprob=lp, top_logprobs=top))
            else:
                outputs.append(RowOutput(r.request_id))
        return StepResult(plan.step, tuple(outputs))
