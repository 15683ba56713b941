"""The engine thread's admission window: requests that reach an idle loop together are planned in the
same (idle, large-prefill) step; a loop with live requests never waits for more.

The window constants are patched to generous values so that a loaded machine's thread scheduling
cannot decide a test: a behaviour that is wrong shows up as waiting the whole (long) window or as a
first plan without the whole burst, never as a few milliseconds more or less.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable

import pytest

import engine.loop as loop_module
from engine.contracts import StepPlan, StepResult
from engine.loop import EngineLoop
from engine.request import SamplingParams
from engine.scheduler import Scheduler
from fake_engine import FakeEngine, prompt

BURST = 4
PROMPT_LEN = 8              # BURST prompts fit one idle step of the engine below (4 rows, 64 tokens)
GIVE_UP_S = 30.0            # far below the patched windows a wrong loop would wait


class Spelling:
    """The loop's detokenizer needs a tokenizer; these tests only look at plans."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(f"<{i}>" for i in ids)


@dataclass
class SteppedEngine(FakeEngine):
    """FakeEngine that calls `on_step(plan)` on the engine thread after each step."""
    on_step: Callable[[StepPlan], None] | None = None

    def execute(self, plan: StepPlan) -> StepResult:
        result = super().execute(plan)
        if self.on_step is not None:
            self.on_step(plan)
        return result


@pytest.fixture
def engine_and_loop():
    engine = SteppedEngine(max_rows=BURST, num_blocks=256, mixed_prefill_tokens_total=4)
    loop = EngineLoop(Scheduler(engine, prefix_cache=False), Spelling(), eos_token_ids=())
    yield engine, loop
    loop.stop()


def set_window(monkeypatch, quiet_s: float, cap_s: float) -> None:
    monkeypatch.setattr(loop_module, "ADMIT_WINDOW_S", quiet_s)
    monkeypatch.setattr(loop_module, "ADMIT_WINDOW_CAP_S", cap_s)


def params(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def first_plan_with(engine: FakeEngine, rid: str) -> StepPlan:
    deadline = time.monotonic() + GIVE_UP_S
    while time.monotonic() < deadline:
        plan = next((p for p in list(engine.plans) if any(r.request_id == rid for r in p.rows)), None)
        if plan is not None:
            return plan
        time.sleep(0.005)
    raise AssertionError(f"{rid} was not planned within {GIVE_UP_S} s")


def test_a_burst_into_the_idle_loop_is_planned_in_one_step(engine_and_loop, monkeypatch):
    engine, loop = engine_and_loop
    set_window(monkeypatch, quiet_s=0.5, cap_s=GIVE_UP_S * 2)
    loop.start()
    for burst in range(2):          # the second burst finds the loop idle again after a drain
        handles = []

        def submit_apart():
            for i in range(BURST):
                handles.append(loop.submit(list(prompt(PROMPT_LEN, seed=burst * BURST + i)),
                                           params(3), bounded=False))
                time.sleep(0.001)
        submitter = threading.Thread(target=submit_apart)
        submitter.start()
        submitter.join()
        first = first_plan_with(engine, handles[0].id)
        assert {r.request_id for r in first.rows} == {h.id for h in handles}
        assert all(r.kind.value == "prefill" and r.sample for r in first.rows)  # whole prompts
        assert all(len(h.result().token_ids) == 3 for h in handles)


@pytest.mark.parametrize("quiet_s, cap_s", [(60.0, 0.05), (0.05, 60.0)],
                         ids=["cap-ends-the-wait", "quiet-gap-ends-the-wait"])
def test_a_lone_request_waits_only_the_shorter_bound(engine_and_loop, monkeypatch, quiet_s, cap_s):
    engine, loop = engine_and_loop
    set_window(monkeypatch, quiet_s, cap_s)
    loop.start()
    handle = loop.submit(list(prompt(PROMPT_LEN)), params(2), bounded=False)
    first_plan_with(engine, handle.id)           # planned long before the 60 s bound
    assert len(handle.result().token_ids) == 2


def test_a_busy_loop_plans_a_new_request_in_the_next_step(engine_and_loop, monkeypatch):
    engine, loop = engine_and_loop
    set_window(monkeypatch, quiet_s=GIVE_UP_S * 2, cap_s=GIVE_UP_S * 2)
    decoding = loop.submit(list(prompt(PROMPT_LEN)), params(400), bounded=False)
    loop.run_once()                              # inline: prefilled, decoding before the thread runs
    late: list = []
    submit_at_step = engine.plans[-1].step + 2

    def submit_while_busy(plan: StepPlan) -> None:
        if plan.step == submit_at_step:         # on the engine thread, between two steps' plans
            late.append(loop.submit(list(prompt(PROMPT_LEN, seed=7)), params(2), request_id="late",
                                    bounded=False))
    engine.on_step = submit_while_busy
    loop.start()
    plan = first_plan_with(engine, "late")
    assert late and plan.step == submit_at_step + 1
    assert {r.request_id for r in plan.rows} == {decoding.id, late[0].id}
    assert len(late[0].result().token_ids) == 2
