"""Fair prefill (DESIGN.md scheduler behaviour 3): round-robin quanta over the requests that are
prefilling, within a step's token budget. No torch."""
from __future__ import annotations

from typing import Callable


class PrefillRotation:
    """The prefilling requests in round-robin order; those served in a step move to the back, so the
    others go first in the next."""

    def __init__(self) -> None:
        self.order: list[str] = []

    def add(self, request_id: str) -> None:
        self.order.append(request_id)

    def discard(self, request_id: str) -> None:
        if request_id in self.order:
            self.order.remove(request_id)

    def grant(self, left: Callable[[str], int], budget: int, *, row_cap: int, quantum: int,
              per_row: int) -> dict[str, int]:
        """Tokens per request for this step: quanta in rotation order, repeated while `budget`
        remains; at most `row_cap` requests and `per_row` tokens each, never more than `left(id)`
        (what the request still has to prefill now)."""
        grants: dict[str, int] = {}
        quantum, progress = max(1, quantum), True
        while progress and budget > 0:
            progress = False
            for rid in self.order:
                have = grants.get(rid, 0)
                if budget == 0 or (have == 0 and len(grants) >= row_cap):
                    continue
                grant = min(quantum, left(rid) - have, per_row - have, budget)
                if grant > 0:
                    grants[rid] = have + grant
                    budget -= grant
                    progress = True
        self.order = [rid for rid in self.order if rid not in grants] + [rid for rid in self.order if rid in grants]
        return grants
