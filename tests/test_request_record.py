"""The loop's one record per request (engine/output.py RequestHandle): token times shared by every
reader and the statistics, groups cancelled together, queued requests shed on drain. Tiny fp32 model."""
from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.request import FinishReason

RUN = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    path = str(tiny_checkpoint("qwen3", tied=False, heads=4, kv_heads=2, head_dim=32, max_pos=512))
    engine = LLM(model=path, dtype="float32", max_model_len=128, kv_pool_tokens=1024, max_concurrency=2)
    yield engine
    engine.close()


def _drain(loop, handles):
    loop.run_until_idle()
    return [h.result() for h in handles]


def test_token_times_are_the_engines_and_feed_its_statistics(llm):
    loop = llm.engine.loop
    handle = loop.submit([5, 6, 7], RUN, bounded=False)
    while not handle.finished:
        loop.run_once()
    deltas = list(handle)
    times = [t for d in deltas for t in d.token_times]
    req = handle.request
    assert len(times) == 6 and times == sorted(times)
    assert (times[0], times[-1]) == (req.first_token_time, req.last_token_time)
    assert req.arrival_time <= times[0]
    # the scheduler's latency samples are the same instants: the last TTFT sample is this request's
    assert loop.scheduler._recorder.ttft[-1] == times[0] - req.arrival_time
    assert list(loop.scheduler._recorder.itl)[-5:] == [b - a for a, b in zip(times, times[1:])]


def test_a_group_is_cancelled_together_and_only_it(llm):
    loop = llm.engine.loop
    first = loop.submit([1, 2, 3], RUN, request_id="g", bounded=False)
    second = loop.submit([1, 2, 3], RUN, request_id="g-1", group="g", after="g", bounded=False)
    other = loop.submit([4, 5], RUN, bounded=False)
    loop.run_once()
    assert loop.is_live("g") and loop.is_live("g-1")
    loop.cancel("g")
    a, b, c = _drain(loop, [first, second, other])
    assert (a.finish_reason, b.finish_reason) == (FinishReason.CANCELLED, FinishReason.CANCELLED)
    assert c.finish_reason is FinishReason.LENGTH and len(c.token_ids) == 6
    assert not loop.is_live("g") and loop.num_unfinished == 0


def test_shed_cancels_only_requests_not_started(llm):
    loop = llm.engine.loop
    running = [loop.submit([i + 1, 2, 3], RUN, bounded=False) for i in range(2)]   # both rows
    queued = loop.submit([9, 9, 9], RUN, bounded=False)
    loop.run_once()
    assert queued.request.state.value == "waiting"
    loop.shed_waiting("shutting down")
    results = _drain(loop, [*running, queued])
    assert [r.finish_reason for r in results[:2]] == [FinishReason.LENGTH] * 2
    assert (results[2].finish_reason, results[2].error, results[2].token_ids) == (
        FinishReason.CANCELLED, "shutting down", [])
    assert loop.num_unfinished == 0 and llm.engine.scheduler.stats().blocks_used == 0
