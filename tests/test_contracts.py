"""check_result catches engine bugs; check_plan catches scheduler bugs (hand-built plans)."""
from __future__ import annotations

import pytest

from engine.contracts import (ContractError, PlanRow, RowKind, RowOutput, StepPlan, StepResult,
                              check_plan, check_result)
from engine.request import SamplingParams

PARAMS = SamplingParams(temperature=0)


def row(rid: str, kind=RowKind.DECODE, tokens=(5,), sample=True) -> PlanRow:
    return PlanRow(rid, kind, tuple(tokens), 0, (0,), None, sample, PARAMS if sample else None, fresh=True)


PLAN = StepPlan(7, (row("a"), row("b", RowKind.PREFILL, (1, 2, 3), sample=False)))
GOOD = StepResult(7, (RowOutput("a", token=9), RowOutput("b")))


def test_a_correct_result_passes():
    check_result(PLAN, GOOD)
    check_result(PLAN, StepResult(7, (RowOutput("a", error="boom"), RowOutput("b"))))
    check_result(PLAN, StepResult(7, error="device lost"))


@pytest.mark.parametrize("result, message", [
    (StepResult(7, (RowOutput("a", token=9),)), "1 outputs for 2 rows"),
    (StepResult(7, (RowOutput("a", token=9), RowOutput("a", token=9))), "output for a where b"),
    (StepResult(7, (RowOutput("a", token=9), RowOutput("b", token=3))), "non-sampling row b"),
    (StepResult(7, (RowOutput("a"), RowOutput("b"))), "sampling row a got no token"),
    (StepResult(8, GOOD.rows), "result for step 8 answers plan 7"),
    (StepResult(7, GOOD.rows, error="oom"), "step error carries 2 rows"),
    (StepResult(7, (RowOutput("a", token=1, error="nan"), RowOutput("b"))), "failed row a has a token"),
    (StepResult(7, (RowOutput("b"), RowOutput("a", token=9))), "output for b where a"),
])
def test_check_result_catches_engine_bugs(result, message):
    with pytest.raises(ContractError, match=message):
        check_result(PLAN, result)


def test_check_plan_accepts_a_valid_plan():
    check_plan(PLAN, {"a"})


@pytest.mark.parametrize("rows, decoders, message", [
    ((row("a"), row("a")), {"a"}, "appears twice"),
    ((row("a", RowKind.PREFILL, (), sample=False),), set(), "feeds no tokens"),
    ((row("a", tokens=(1, 2)),), {"a"}, "decode row a feeds 2 tokens"),
    ((row("a"),), {"a", "c"}, r"running decoders missing: \['c'\]"),
    ((PlanRow("a", RowKind.DECODE, (1,), 0, (0,), None, True, None),), {"a"}, "samples without params"),
])
def test_check_plan_catches_scheduler_bugs(rows, decoders, message):
    with pytest.raises(ContractError, match=message):
        check_plan(StepPlan(1, rows), decoders)
