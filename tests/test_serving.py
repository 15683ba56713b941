"""The scheduler, runner and loop together on tiny fp32 models: concurrency never changes an answer,
cancellation and failures free everything, slow readers only slow themselves."""
from __future__ import annotations

import threading
import time

import pytest
import torch

import engine.builder as builder
from fake_engine import record_plans
from engine import LLM, SamplingParams
from engine.config import ConfigError
from engine.request import FinishReason
from engine.scheduler import RequestRejected

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def model_path(tiny_checkpoint):
    return str(tiny_checkpoint("qwen3", tied=False, heads=8, kv_heads=2, head_dim=32,
                               max_pos=2048))


def _llm(path, **kw):
    kw.setdefault("dtype", "float32")
    kw.setdefault("max_model_len", 256)
    kw.setdefault("kv_pool_tokens", 4096)
    return LLM(model=path, **kw)


def _prompts(n, lo=5, hi=40, seed=0):
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi, (n,), generator=gen).tolist()
    return [torch.randint(0, 400, (k,), generator=gen).tolist() for k in lens]


def test_more_requests_than_rows_all_match_alone(model_path):
    llm = _llm(model_path, max_concurrency=3)
    prompts = _prompts(6)
    plans = record_plans(llm.engine)
    together = llm.generate(prompts, GREEDY)
    assert max(len(p.rows) for p, _ in plans) == 3          # really ran 3 at a time
    alone = [llm.generate([p], GREEDY)[0] for p in prompts]
    assert [o.token_ids for o in together] == [o.token_ids for o in alone]
    assert all(len(o.token_ids) == 10 for o in together)


def test_decoder_gets_a_token_every_step_while_long_prompt_prefills(model_path):
    llm = _llm(model_path, max_model_len=1100, kv_pool_tokens=4096)
    loop = llm.engine.loop
    plans = record_plans(llm.engine)
    short = loop.submit(_prompts(1)[0], SamplingParams(temperature=0, max_tokens=200,
                                                       ignore_eos=True), bounded=False)
    while not any(r.request_id == short.id and r.kind.value == "decode" for p, _ in plans
                  for r in p.rows):
        loop.run_once()
    long = loop.submit(list(range(1, 401)) * 2 + list(range(1, 201)), GREEDY, bounded=False)
    loop.run_until_idle()
    prefill_steps = [(p, r) for p, r in plans
                     if any(row.request_id == long.id and row.kind.value == "prefill"
                            for row in p.rows)]
    assert len(prefill_steps) > 5                              # the long prompt took many steps
    for plan, result in prefill_steps:
        if any(row.request_id == short.id for row in plan.rows):
            out = next(o for o in result.rows if o.request_id == short.id)
            assert out.token is not None
    decoding = [p for p, _ in prefill_steps if any(r.request_id == short.id for r in p.rows)]
    assert len(decoding) >= min(len(prefill_steps), 190) - 1   # short never sat out a step
    assert short.result().token_ids and long.result().finish_reason is FinishReason.LENGTH


@pytest.mark.parametrize("phase", ["prefill", "decode"])
def test_cancel_frees_everything_within_one_step(model_path, phase):
    llm = _llm(model_path, max_model_len=1100)
    llm.engine.runner.budget = type(llm.engine.runner.budget)(idle_total=64, mixed_total=16,
                                                              quantum=16)
    loop, sched = llm.engine.loop, llm.engine.scheduler
    h = loop.submit(list(range(1, 301)), SamplingParams(temperature=0, max_tokens=500,
                                                        ignore_eos=True), bounded=False)
    loop.run_once()
    loop.run_once()
    if phase == "decode":
        while sched.get(h.id).state.value != "decode":
            loop.run_once()
        loop.run_once()
    assert sched.stats().blocks_used > 0
    h.cancel()
    loop.run_once()
    stats = sched.stats()
    assert stats.blocks_used == 0 and stats.running == 0 and stats.waiting == 0
    assert h.result().finish_reason is FinishReason.CANCELLED


def test_cancelled_waiting_request_never_runs(model_path):
    llm = _llm(model_path, max_concurrency=1)
    loop = llm.engine.loop
    plans = record_plans(llm.engine)
    first = loop.submit(_prompts(1)[0], GREEDY, bounded=False)
    second = loop.submit(_prompts(1, seed=3)[0], GREEDY, bounded=False)
    loop.run_once()
    second.cancel()
    loop.run_until_idle()
    assert second.result().finish_reason is FinishReason.CANCELLED
    assert not any(r.request_id == second.id for p, _ in plans for r in p.rows)
    assert len(first.result().token_ids) == 10


def test_small_pool_preempts_and_outputs_stay_identical(model_path):
    prompts = _prompts(4, lo=20, hi=30, seed=5)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    roomy = _llm(model_path).generate(prompts, params)
    tight = _llm(model_path, max_model_len=64, kv_pool_tokens=96, max_concurrency=4)
    outs = tight.generate(prompts, params)
    assert tight.engine.scheduler.stats().preemptions_total > 0
    assert [o.token_ids for o in outs] == [o.token_ids for o in roomy]
    assert tight.engine.scheduler.stats().blocks_used == 0


def test_seeded_sampling_is_batch_independent(model_path):
    llm = _llm(model_path)
    seeded = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=1234, max_tokens=16,
                            ignore_eos=True)
    prompt = _prompts(1, seed=9)[0]
    alone = llm.generate([prompt], seeded)[0].token_ids
    noise = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    batch = llm.generate([prompt] + _prompts(3), [seeded, noise, noise, noise])[0].token_ids
    assert alone == batch
    other_seed = llm.generate([prompt], SamplingParams(temperature=0.9, top_p=0.9, top_k=50,
                                                       seed=99, max_tokens=16,
                                                       ignore_eos=True))[0].token_ids
    assert other_seed != alone


def test_stop_string_across_token_boundary(model_path):
    llm = _llm(model_path)
    prompt = _prompts(1, seed=11)[0]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    full = llm.generate([prompt], params)[0]
    pieces = [llm.tokenizer.decode([t]) for t in full.token_ids]
    # a stop string made of the last char of token 4 and the first char of token 5
    k = next(i for i in range(3, 20) if pieces[i] and pieces[i + 1] and "\ufffd" not in
             pieces[i] + pieces[i + 1])
    stop = pieces[k][-1] + pieces[k + 1][0]
    expected = full.text[:full.text.index(stop)]
    stopped = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24,
                                                    ignore_eos=True, stop=[stop]))[0]
    assert stopped.text == expected
    assert stopped.finish_reason is FinishReason.STOP
    assert llm.engine.scheduler.stats().blocks_used == 0


def test_streaming_equals_non_streaming(model_path):
    llm = _llm(model_path)
    prompt = _prompts(1, seed=4)[0]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    whole = llm.generate([prompt], params)[0]
    loop = llm.engine.loop
    loop.start()
    try:
        deltas = list(loop.submit(prompt, params))
    finally:
        loop.stop()
    assert "".join(d.text for d in deltas) == whole.text
    assert [t for d in deltas for t in d.token_ids] == whole.token_ids


@pytest.mark.timeout(120)     # a `run` that ignores `until` never returns
def test_run_steps_in_the_calling_thread_until_told_to_stop(model_path):
    """EngineLoop.run: others submit and read while this thread steps; it returns once `until` is set."""
    llm = _llm(model_path)
    prompt = _prompts(1, seed=4)[0]
    whole = llm.generate([prompt], GREEDY)[0]
    loop, stepped_on, streamed = llm.engine.loop, set(), []
    execute = llm.engine.runner.execute

    def recording(plan):
        stepped_on.add(threading.current_thread())
        return execute(plan)
    llm.engine.runner.execute = recording
    until = threading.Event()

    def client() -> None:
        streamed.extend(t for d in loop.submit(prompt, GREEDY) for t in d.token_ids)
        until.set()
        loop.wake()
    threading.Thread(target=client, daemon=True).start()
    loop.run(until)
    assert streamed == whole.token_ids
    assert stepped_on == {threading.current_thread()}


def test_engine_loads_on_a_thread_that_has_ended_and_its_errors_reach_the_caller(model_path,
                                                                                 monkeypatch):
    """No OpenMP pool from the loading work stays on the caller's thread (see build_engine)."""
    loaded_on = []
    real = builder._build

    def recording(cfg, progress):
        loaded_on.append(threading.current_thread())
        return real(cfg, progress)
    monkeypatch.setattr(builder, "_build", recording)
    llm = _llm(model_path)
    assert loaded_on[0] is not threading.current_thread() and not loaded_on[0].is_alive()
    assert len(llm.generate(_prompts(1), GREEDY)[0].token_ids) == 10
    with pytest.raises(ConfigError, match='dtype = "float16" has no fast path on CPUs'):
        _llm(model_path, device="cpu", dtype="float16")


def test_step_exception_fails_live_requests_and_serving_continues(model_path):
    llm = _llm(model_path)
    runner = llm.engine.runner
    real = runner.model.forward
    calls = {"n": 0}

    def flaky(batch, kv):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected failure")
        return real(batch, kv)
    runner.model.forward = flaky
    outs = llm.generate(_prompts(2), GREEDY)
    assert all(o.finish_reason is FinishReason.ERROR and "injected" in o.error for o in outs)
    assert llm.engine.scheduler.stats().blocks_used == 0
    after = llm.generate(_prompts(1), GREEDY)[0]
    assert after.finish_reason is FinishReason.LENGTH and len(after.token_ids) == 10


def test_too_long_prompt_fails_with_numbers_and_leaves_nothing_queued(model_path):
    llm = _llm(model_path, max_model_len=64)
    with pytest.raises(RequestRejected, match="prompt has 100 tokens; max_model_len is 64"):
        llm.generate([_prompts(1)[0], list(range(1, 101))], GREEDY)
    stats = llm.engine.scheduler.stats()
    assert stats.waiting == stats.running == stats.blocks_used == 0
    assert len(llm.generate(_prompts(1), GREEDY)[0].token_ids) == 10


def test_slow_reader_pauses_only_itself_and_stalled_reader_is_cancelled(model_path):
    llm = _llm(model_path, client_max_lag_tokens=4, client_timeout_s=1.5)
    loop, sched = llm.engine.loop, llm.engine.scheduler
    long = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    expected = llm.generate([_prompts(1, seed=2)[0]], long)[0].token_ids
    loop.start()
    try:
        slow = loop.submit(_prompts(1, seed=2)[0], long)
        fast = loop.submit(_prompts(1, seed=3)[0], long)
        fast_out = fast.result()                     # read eagerly: finishes while slow is paused
        assert len(fast_out.token_ids) == 60
        row = next(r for r in sched.stats().requests if r.id == slow.id)
        assert row.state == "paused" and row.generated_tokens < 60
        tokens = [t for d in slow for t in d.token_ids]   # reading resumes it
        assert tokens == expected
        stalled = loop.submit(_prompts(1, seed=6)[0], long)
        deadline = time.monotonic() + 10
        while not stalled.finished and time.monotonic() < deadline:
            time.sleep(0.1)
        last = list(stalled)[-1]
        assert last.finish_reason is FinishReason.CANCELLED and "stalled" in last.error
    finally:
        loop.stop()
    assert sched.stats().blocks_used == 0
