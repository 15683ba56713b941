"""The draft model of `speculative = "draft"`: a small model with the target's vocabulary that
proposes the tokens of the rows asking for them (PlanRow.draft_k), in the step that verifies them.

Its K/V sits in a pool of its own under the target's block ids, so a request's blocks hold both
models' K/V: the scheduler's one block accounting serves both, and the draft's K/V goes back with
the blocks. The draft reads a request's tokens only when the request asks for proposals: until
then they wait in a backlog (from a fresh row on, the part of its cached prefix whose blocks the
draft has not read: `cached_token_ids`), so steps without proposals, e.g. a full batch on a CPU,
cost nothing more than without a draft. A block whose every position the draft read stays valid
for it until the block is handed out again, so a prompt cached with the draft's K/V is not reread.
A step reads at most `read_per_step` backlog tokens; a row still catching up gets no proposals.
Then the draft proposes greedily, one token per row and forward, while it is sure (`p_min`): the
first token it is unsure of ends the row's proposals, and is proposed too. A greedy proposal keeps
the verification exact for random draws too: the rule for a point-mass proposal
(engine/speculation.py) holds whatever chose the point.

A hybrid draft keeps its recurrent state in a state pool of its own: a slot per row of the
runner's persistent batch (a fresh row resets it and reads from position 0), then as many scratch
slots. It proposes from a copy in a scratch slot, so its own slot only ever reads real tokens, and
its accepted proposals go to the backlog to be read in the next step.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable

import torch

from engine.contracts import PlanRow, RowOutput
from engine.kv.pool import KVPool, StatePool
from engine.models.batch import ForwardBatch
from engine.models.decoder import DecoderModel
from engine.plan_ledger import RowRecord
from engine.speculation import accepted_run

BatchOf = Callable[[list[PlanRow], list[RowRecord]], ForwardBatch]
# A row's proposals end with the first token the draft gives less than this probability (llama.cpp's
# --draft-p-min): a proposal after it would cost a draft forward for a likely rejection. That token itself
# is proposed: its forward is paid for, a verify position costs a fraction of one, and it is often right
P_MIN = 0.75


@dataclass
class _Backlog:
    """The draft's K/V holds a request's positions below `start`; `tokens` are its real tokens from
    `start` on that the draft has not read, up to the position of the request's next row."""
    start: int
    tokens: list[int] = field(default_factory=list)


class DraftModel:
    def __init__(self, model: DecoderModel, pool: KVPool, read_per_step: int,
                 state_pool: StatePool | None = None, p_min: float = P_MIN) -> None:
        self.model = model
        self.p_min = p_min
        self.pool = pool
        self.read_per_step = read_per_step
        self.state_pool = state_pool        # hybrid drafts: 2 x max_rows slots (own, then scratch)
        self._scratch = None if state_pool is None else state_pool.num_slots // 2
        self._backlog: dict[str, _Backlog] = {}
        self._read: dict[str, int] = {}         # this step: tokens read from backlog + row
        self._valid: set[int] = set()           # blocks whose K/V the draft read whole

    def _greedy(self, batch: ForwardBatch, slots: list[int]) -> list[tuple[int, float]]:
        """Each sampling row's most likely next token and its probability."""
        if self.state_pool is None:
            hidden = self.model.forward(batch, self.pool.layers)
        else:
            index = torch.tensor(slots, dtype=torch.int32).to(batch.input_ids.device)
            hidden = self.model.forward(batch, self.pool.layers, self.state_pool.layers, index)
        probs, tokens = self.model.logits(hidden).softmax(-1).max(-1)
        return list(zip(tokens.tolist(), probs.tolist()))

    def _log(self, row: PlanRow, rec: RowRecord) -> _Backlog:
        bs = self.pool.shape.block_size
        below = row.start_pos // bs         # blocks wholly before the row: a fresh row's cached prefix
        self._valid.difference_update(rec.block_table[below:] if row.fresh else row.new_blocks)   # handed out
        log = self._backlog.get(row.request_id)
        if row.fresh or log is None or log.start + len(log.tokens) != row.start_pos:
            # a dense draft resumes after the leading blocks it read whole; a recurrent state cannot
            lead = 0
            while self.state_pool is None and lead < below and rec.block_table[lead] in self._valid:
                lead += 1
            start = max(lead * bs, row.start_pos - len(row.cached_token_ids))
            log = self._backlog[row.request_id] = _Backlog(start, list(row.cached_token_ids[start:]))
            if self.state_pool is not None:
                self.state_pool.reset(rec.index)
        return log

    def propose(self, rows: list[PlanRow], records: list[RowRecord], batch_of: BatchOf) -> list[PlanRow]:
        """Read the backlogs of the rows asking for proposals and propose for those caught up;
        returns the rows as the target is to run them (those as verify rows feeding their
        proposals, possibly none)."""
        reads, read_recs, drafting, budget = [], [], [], self.read_per_step
        self._read = {}
        for row, rec in zip(rows, records):
            log = self._log(row, rec)
            if not row.draft_k:
                continue
            unread = log.tokens + list(row.token_ids)
            n = min(len(unread), budget)
            if n == 0:
                continue
            budget -= n
            self._read[row.request_id] = n
            caught_up = n == len(unread)
            reads.append(replace(row, token_ids=tuple(unread[:n]), start_pos=log.start, sample=caught_up,
                                 num_draft=0, draft_k=0, fresh=False))
            read_recs.append(rec)
            if caught_up:
                drafting.append((len(reads) - 1, row))
        proposals: dict[str, list[int]] = {row.request_id: [] for _, row in drafting}
        unsure: set[str] = set()

        def add(row: PlanRow, token: int, p: float) -> None:
            proposals[row.request_id].append(token)
            if p < self.p_min:
                unsure.add(row.request_id)
        if reads:
            drawn = self._greedy(batch_of(reads, read_recs), [rec.index for rec in read_recs])
            for (_, row), (t, p) in zip(drafting, drawn):
                add(row, t, p)
        scratch = {}
        if self.state_pool is not None:
            for n, (i, row) in enumerate(drafting):
                scratch[row.request_id] = self._scratch + n
                self.state_pool.copy(read_recs[i].index, self._scratch + n)
        for step in range(1, max((row.draft_k for _, row in drafting), default=0)):
            # rows still sure after `step` proposals
            ahead = [(i, row) for i, row in drafting if row.draft_k > step and row.request_id not in unsure]
            if not ahead:
                break
            feeds = [replace(reads[i], token_ids=(proposals[row.request_id][-1],), start_pos=row.start_pos + step)
                     for i, row in ahead]
            slots = [scratch.get(row.request_id) for _, row in ahead]
            drawn = self._greedy(batch_of(feeds, [read_recs[i] for i, _ in ahead]), slots)
            for (_, row), (t, p) in zip(ahead, drawn):
                add(row, t, p)
                if self.state_pool is None:     # a hybrid draft's slot read none of its proposals
                    self._read[row.request_id] += 1
        return [row.with_proposals(tuple(proposals.get(row.request_id, ()))) if row.draft_k else row
                for row in rows]

    def seen(self, rows: list[PlanRow], records: list[RowRecord], drawn: dict[str, RowOutput]) -> None:
        """After the target's draws: each backlog gains the row's real tokens (a verify row's are
        real up to its first rejected proposal) and loses what the draft read of them; the blocks
        it has now read whole become valid."""
        bs = self.pool.shape.block_size
        for row, rec in zip(rows, records):
            log = self._backlog.get(row.request_id)
            if log is None:
                continue
            out = drawn.get(row.request_id)
            real = len(accepted_run(row, out)) if row.num_draft and out is not None else len(row.token_ids)
            stream = log.tokens + list(row.token_ids[:real])
            read = min(self._read.get(row.request_id, 0), len(stream))
            self._valid.update(rec.block_table[log.start // bs:(log.start + read) // bs])
            log.start, log.tokens = log.start + read, stream[read:]

    def forget(self, request_id: str) -> None:
        self._backlog.pop(request_id, None)


def check_draft(draft: DecoderModel, target: DecoderModel, max_model_len: int) -> list[str]:
    """Why `draft` cannot propose for `target`, if it cannot."""
    problems = []
    if draft.cfg.vocab_size != target.cfg.vocab_size:
        problems.append(f"the draft model's vocabulary has {draft.cfg.vocab_size:,} tokens and the "
                        f"target's {target.cfg.vocab_size:,}: a draft must share the target's tokenizer")
    if draft.cfg.max_position_embeddings < max_model_len:
        problems.append(f"the draft model handles {draft.cfg.max_position_embeddings:,} positions, fewer "
                        f"than max_model_len = {max_model_len:,}; lower max_model_len")
    return problems
