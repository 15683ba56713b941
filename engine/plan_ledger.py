"""The engine's record of each request it runs, kept from the plans' deltas. No torch here.

A fresh row opens a record (its whole block table, a row index in the engine's persistent batch);
later rows append their new blocks and must start where the record's computed positions end, so a
lost or repeated delta is a contract error instead of wrong attention. After a verify row the next
may start earlier, past its first position at least: the proposals rejected there are dead, and
it drops the blocks they alone needed. `StepPlan.forget` closes records. The same plans replayed
into a new ledger give the same records.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.contracts import ContractError, StepPlan


@dataclass
class RowRecord:
    request_id: str
    index: int                      # the request's row in the engine's persistent batch buffers
    block_table: list[int] = field(default_factory=list)
    computed: int = 0               # positions whose K/V the engine has written
    floor: int = 0                  # where the next row may start at the earliest: below
                                    # `computed` only after a verify row


class PlanLedger:
    def __init__(self, max_rows: int) -> None:
        self.records: dict[str, RowRecord] = {}
        self._free = list(range(max_rows - 1, -1, -1))

    def begin(self, plan: StepPlan) -> tuple[list[RowRecord], list[RowRecord]]:
        """Apply the plan's deltas; returns the closed records and each row's record, in row order.
        A row that breaks the deltas raises ContractError (the scheduler has a bug)."""
        closed = [self.records.pop(rid) for rid in plan.forget if rid in self.records]
        self._free += [rec.index for rec in closed]
        rows = []
        for row in plan.rows:
            rec = self.records.get(row.request_id)
            if row.fresh:
                if rec is not None:
                    raise ContractError(f"step {plan.step}: fresh row for {row.request_id}, which "
                                        "the engine still holds")
                if not self._free:
                    raise ContractError(f"step {plan.step}: more live requests than the engine's "
                                        f"{len(self.records)} rows")
                rec = RowRecord(row.request_id, self._free.pop(), list(row.new_blocks), row.start_pos,
                                row.start_pos)
                self.records[row.request_id] = rec
            else:
                if rec is None:
                    raise ContractError(f"step {plan.step}: row {row.request_id} is not fresh, and "
                                        "the engine holds no record of it")
                if not rec.floor <= row.start_pos <= rec.computed:
                    verified = f" (verified from {rec.floor})" if rec.floor < rec.computed else ""
                    raise ContractError(f"step {plan.step}: row {row.request_id} starts at "
                                        f"{row.start_pos}; the engine has computed {rec.computed}{verified}")
                if row.drop_blocks > len(rec.block_table):
                    raise ContractError(f"step {plan.step}: row {row.request_id} drops {row.drop_blocks} "
                                        f"blocks of {len(rec.block_table)}")
                del rec.block_table[len(rec.block_table) - row.drop_blocks:]
                rec.block_table += row.new_blocks
            rows.append(rec)
        return closed, rows

    def commit(self, plan: StepPlan, rows: list[RowRecord]) -> None:
        """The step ran: each row's positions are computed (a verify row's proposals only until the
        next row says which were accepted)."""
        for row, rec in zip(plan.rows, rows):
            rec.computed = row.end_pos
            rec.floor = row.end_pos - row.num_proposed
