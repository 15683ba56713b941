"""Debug-only fault injection, for the fault suite (bench/faults.py): inert unless its environment
variable is set, and read once per process, so the step loop pays one set lookup.

`PAGEDSERVE_DEBUG_FAIL_STEPS="3,7"`: ModelRunner.execute raises in steps 3 and 7 (StepPlan.step,
counted from 0 over the steps that had rows), which must fail those steps' live requests with a
clear error while the engine keeps serving new ones.
"""
from __future__ import annotations

import functools
import os

FAIL_STEPS_ENV = "PAGEDSERVE_DEBUG_FAIL_STEPS"


class InjectedStepFailure(RuntimeError):
    """The failure a debug hook raises in place of a real one."""


@functools.cache
def fail_steps() -> frozenset[int]:
    return parse_steps(os.environ.get(FAIL_STEPS_ENV, ""))


def parse_steps(text: str) -> frozenset[int]:
    """ "3, 7" -> {3, 7}; a bad value fails loudly rather than injecting nothing."""
    try:
        return frozenset(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise ValueError(f"{FAIL_STEPS_ENV}={text!r}: give step numbers separated by commas, e.g. 3,7") from None


def check_step(step: int) -> None:
    if step in fail_steps():
        raise InjectedStepFailure(f"step {step} failed on purpose ({FAIL_STEPS_ENV})")
