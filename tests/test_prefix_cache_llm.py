"""Prefix caching on a tiny random Qwen3 in fp32: greedy outputs with the cache on are exactly those
with it off (which the equivalence tests hold to transformers), and the cache is really hit."""
from __future__ import annotations

import pytest
import torch
from tiny_models import hf_model, make_hybrid_checkpoint

from engine import LLM
from engine.request import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
MAKE = dict(dtype="float32", max_model_len=256, max_concurrency=4, block_size=16)


def ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, 400, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def pair(tiny_checkpoint):
    path = str(tiny_checkpoint("qwen3"))
    on, off = (LLM(model=path, prefix_cache=flag, kv_pool_tokens=2048, **MAKE) for flag in (True, False))
    yield on, off
    on.close(), off.close()


def outputs(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [c.token_ids for c in llm.generate(prompts, GREEDY)]


def test_multi_turn_conversation_hits_the_previous_turns(pair, tiny_checkpoint):
    on, off = pair
    before = on.engine.scheduler.stats().prefix_cache_hit_tokens
    history: list[int] = []
    cached = []
    for turn in range(3):
        history += ids(23 + 7 * turn, seed=turn)
        [got], [alone] = on.generate([history], GREEDY), off.generate([history], GREEDY)
        assert got.token_ids == alone.token_ids, f"turn {turn}"
        assert alone.cached_tokens == 0 and got.prompt_tokens == len(history)
        cached.append(got.cached_tokens)
        history += got.token_ids
    hit = on.engine.scheduler.stats().prefix_cache_hit_tokens - before
    # turn 2 reuses turn 1's 23 prompt + 7 fed reply tokens (1 block), turn 3 turn 2's 68 (4 blocks)
    assert hit == 16 + 64 and cached == [0, 16, 64]
    hf = hf_model(tiny_checkpoint("qwen3"))
    want = hf.generate(torch.tensor([history[:-8]]), max_new_tokens=8, do_sample=False)
    assert want[0, -8:].tolist() == history[-8:], "the last turn matches transformers"


def test_shared_system_prompt_together_and_in_turn(pair):
    on, off = pair
    system = ids(40, seed=10)
    prompts = [system + ids(5 + i, seed=20 + i) for i in range(4)]
    assert outputs(on, prompts) == outputs(off, prompts)       # admitted in one step: no hits yet
    stats = on.engine.scheduler.stats()
    later = [system + ids(9, seed=30), system[:35]]
    assert outputs(on, later) == outputs(off, later)
    after = on.engine.scheduler.stats()
    assert after.prefix_cache_hit_tokens - stats.prefix_cache_hit_tokens == 32 + 32
    assert after.blocks_used == 0 and after.cached_blocks > 0


def test_a_fully_cached_prompt_still_samples_the_same_tokens(pair):
    on, off = pair
    for prompt in (ids(32, seed=40), ids(37, seed=41)):      # block-aligned and not
        first, again = outputs(on, [prompt]), outputs(on, [prompt])
        assert first == again == outputs(off, [prompt])


def test_eviction_under_a_small_pool_keeps_outputs(tiny_checkpoint):
    path = str(tiny_checkpoint("qwen3"))
    make = dict(MAKE, max_model_len=64, kv_pool_tokens=8 * 16)
    small, off = LLM(model=path, prefix_cache=True, **make), LLM(model=path, prefix_cache=False, **make)
    prompts = [ids(40, seed=50 + i) for i in range(4)] + [ids(40, seed=50)]
    got = [outputs(small, [p])[0] for p in prompts]
    assert got == [outputs(off, [p])[0] for p in prompts]
    stats = small.engine.scheduler.stats()
    # each run takes 3 of the 8 blocks and leaves 2 full ones cached (47 fed tokens): the fourth run
    # evicts the least recently used idle block, the tail of the first prompt, so the repeat hits
    # one block and evicts the next LRU block for its own third block
    assert (stats.cache_evictions_total, stats.prefix_cache_hit_tokens, stats.blocks_used) == (2, 16, 0)
    small.close(), off.close()


@pytest.fixture(scope="module")
def hybrid_pair(tmp_path_factory):
    path = str(make_hybrid_checkpoint(tmp_path_factory.mktemp("hybrid"), "qwen3_5"))
    on, off = (LLM(model=path, prefix_cache=flag, kv_pool_tokens=2048, **MAKE) for flag in (True, False))
    yield on, off
    on.close(), off.close()


def test_hybrid_model_resumes_turns_and_a_system_prompt_from_state_checkpoints(hybrid_pair):
    on, off = hybrid_pair
    before = on.engine.scheduler.stats()
    history: list[int] = []
    for turn in range(3):
        history += ids(23 + 7 * turn, seed=60 + turn)
        [got] = outputs(on, [history])
        assert got == outputs(off, [history])[0], f"turn {turn}"
        history += got
    system = ids(40, seed=70)
    for i in range(3):                       # one after another, so each can hit the one before
        prompt = [system + ids(5 + i, seed=80 + i)]
        assert outputs(on, prompt) == outputs(off, prompt), f"system prompt user {i}"
    after = on.engine.scheduler.stats()
    # a checkpoint is kept at the last block boundary before a prompt's final token (and at those
    # reached while decoding): the turns resume at 16 and 64 as for the dense model, and users 2
    # and 3 at 32 of the system prompt's 40 tokens (45 and 46 in their prompts)
    assert after.prefix_cache_hit_tokens - before.prefix_cache_hit_tokens == 16 + 64 + 32 + 32
    assert after.checkpoint_hits_total - before.checkpoint_hits_total == 4
    assert off.engine.scheduler.stats().prefix_cache_hit_tokens == 0
