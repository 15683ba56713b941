"""The debug-only step-failure hook (engine/debug_hooks.py): parsed strictly, inert when unset, and
through the real runner a listed step fails its live requests while the engine serves on."""
from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.debug_hooks import FAIL_STEPS_ENV, InjectedStepFailure, check_step, fail_steps, parse_steps
from engine.request import FinishReason

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture
def failing_steps(monkeypatch):
    """`failing_steps("3,7")` sets the variable as a fresh process would read it."""
    def set_steps(text: str) -> None:
        monkeypatch.setenv(FAIL_STEPS_ENV, text)
        fail_steps.cache_clear()
    yield set_steps
    monkeypatch.delenv(FAIL_STEPS_ENV, raising=False)
    fail_steps.cache_clear()


def test_parse_steps():
    assert parse_steps("") == frozenset() and parse_steps(" 3, 7,") == {3, 7}
    with pytest.raises(ValueError, match=f"{FAIL_STEPS_ENV}='3;7': give step numbers"):
        parse_steps("3;7")


def test_unset_is_inert_and_listed_steps_raise(failing_steps):
    failing_steps("")
    check_step(0)
    failing_steps("2")
    check_step(1)
    with pytest.raises(InjectedStepFailure, match="step 2 failed on purpose"):
        check_step(2)


def test_a_failed_step_fails_its_requests_and_the_engine_serves_on(tiny_checkpoint, failing_steps):
    failing_steps("1")          # step 0 prefills both prompts, step 1 is their first decode
    path = tiny_checkpoint("qwen3", tied=False, heads=8, kv_heads=2, head_dim=32, max_pos=2048)
    llm = LLM(model=str(path), dtype="float32", max_model_len=256, kv_pool_tokens=4096)
    outs = llm.generate([[5, 6, 7], [8, 9, 10, 11]], GREEDY)
    assert all(o.finish_reason is FinishReason.ERROR and "step 1 failed on purpose" in o.error for o in outs)
    assert llm.engine.scheduler.stats().blocks_used == 0
    after = llm.generate([[5, 6, 7]], GREEDY)[0]
    assert after.finish_reason is FinishReason.LENGTH and len(after.token_ids) == 6
