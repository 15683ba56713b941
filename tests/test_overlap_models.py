"""Overlapped scheduling through the real runner on tiny fp32 models, run synchronously on the CPU: the
same tokens, logprobs and finishes as the synchronous scheduler (greedy, seeded draws with penalties,
stop ids and strings, a prefill arriving mid-run, preemption, a hybrid model's state slots), with the
next step's tokens read from the draws the runner holds."""
from __future__ import annotations

import pytest
from conftest import REPEATING_HYBRIDS

from engine import LLM, SamplingParams
from engine.config import ConfigError, EngineConfig
from engine.contracts import PENDING

PROMPTS = [[3, 4] * 10, [7, 8, 9, 10, 11] * 4, list(range(30, 50))]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module", params=["qwen3", "qwen3_5"])
def model_path(request, tiny_checkpoint, repeating_hybrid):
    if request.param in REPEATING_HYBRIDS:
        return repeating_hybrid(request.param)
    return str(tiny_checkpoint("qwen3", tied=False, heads=8, kv_heads=2, head_dim=32, max_pos=2048))


def _llm(path, overlap: bool, **kw):
    kw.setdefault("kv_pool_tokens", 4096)
    kw.setdefault("max_model_len", 256)
    llm = LLM(model=path, dtype="float32", overlap_scheduling="on" if overlap else "off", **kw)
    assert llm.engine.scheduler.overlapped is overlap
    return llm


def _launched_rows(llm) -> list:
    """Every row the runner launches from now on."""
    rows, launch = [], llm.engine.runner.launch

    def recording(plan):
        rows.extend(plan.rows)
        return launch(plan)
    llm.engine.runner.launch = recording
    return rows


def _replies(outs):
    return [(o.token_ids, o.finish_reason, o.logprobs) for o in outs]


def _mid_run(llm, params) -> list:
    """The first prompt alone for a few steps, then the others arrive."""
    loop = llm.engine.loop
    first = loop.submit(PROMPTS[0], params[0], bounded=False)
    for _ in range(5):
        loop.run_once()
    rest = [loop.submit(p, sp, bounded=False) for p, sp in zip(PROMPTS[1:], params[1:])]
    loop.run_until_idle()
    return [h.result() for h in [first, *rest]]


def test_greedy_and_seeded_replies_are_the_synchronous_ones(model_path):
    params = [GREEDY,
              SamplingParams(temperature=0.9, seed=5, max_tokens=24, ignore_eos=True, repetition_penalty=1.3,
                             logprobs=2),
              SamplingParams(temperature=0.7, seed=9, max_tokens=20, ignore_eos=True, presence_penalty=0.5,
                             frequency_penalty=0.3, top_p=0.9)]
    sync = _llm(model_path, overlap=False)
    want = _replies(sync.generate(PROMPTS, params))
    ahead = _llm(model_path, overlap=True)
    rows = _launched_rows(ahead)
    assert _replies(ahead.generate(PROMPTS, params)) == want
    assert sum(r.token_ids[-1] == PENDING for r in rows) >= 3 * 15     # decode rows planned ahead
    assert _replies(_mid_run(ahead, params)) == _replies(_mid_run(sync, params))
    assert ahead.engine.scheduler.stats().blocks_used == 0 and not ahead.engine.scheduler.has_work


def test_stop_ids_and_strings_end_replies_where_they_do_synchronously(model_path):
    sync = _llm(model_path, overlap=False)
    free = sync.generate(PROMPTS, GREEDY)
    params = [SamplingParams(temperature=0, max_tokens=24, stop_token_ids=(free[0].token_ids[6],)),
              SamplingParams(temperature=0, max_tokens=24, stop=[free[1].text[5:9]]),
              GREEDY]
    want = sync.generate(PROMPTS, params)
    assert len(want[0].token_ids) <= 7 and len(want[1].token_ids) < 24
    got = _llm(model_path, overlap=True).generate(PROMPTS, params)
    assert [(o.token_ids, o.text, o.finish_reason) for o in got] == [(o.token_ids, o.text, o.finish_reason)
                                                                     for o in want]


def test_preemption_keeps_the_replies(model_path):
    alone = _llm(model_path, overlap=False).generate(PROMPTS, GREEDY)
    tight = _llm(model_path, overlap=True, kv_pool_tokens=112, block_size=8, max_model_len=64)
    got = tight.generate(PROMPTS, GREEDY)
    assert tight.engine.scheduler.stats().preemptions_total > 0
    assert [o.token_ids for o in got] == [o.token_ids for o in alone]


def test_overlap_is_off_on_cpus_by_default_and_refused_with_speculation(tiny_checkpoint):
    path = str(tiny_checkpoint("qwen3"))
    assert LLM(model=path, dtype="float32", max_model_len=128, kv_pool_tokens=512).engine.scheduler.overlapped is False
    with pytest.raises(ConfigError, match="overlap_scheduling"):
        EngineConfig(overlap_scheduling="on", speculative="ngram")
