"""Warm restarts (prefix_cache_dir, engine/kv/snapshot.py): the prefix cache saved when an engine stops
is read back by the next engine of the same model and layout, hits at once and gives the tokens a cold
engine gives; any other file is left alone and the engine starts cold."""
from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import threading
import time

import openai
import pytest
import torch
from chat_templates import HERMES, chat_model
from server_process import ServerProcess

from console.client import HttpClient
from engine import LLM
from engine.client import EngineClient
from engine.atomic_file import temp_path
from engine.config import ConfigError
from engine.kv.allocator import BlockAllocator
from engine.kv.prefix_cache import Entry, PrefixCache
from engine.kv.snapshot import KVSnapshot, closed_prefix, code_identity
from engine.request import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
MAKE = dict(dtype="float32", max_model_len=256, max_concurrency=2, block_size=16, kv_pool_tokens=1024)


def ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, 400, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def run(path, directory, prompts, **config):
    """Each prompt's completion from a fresh engine, then the engine closed (which saves)."""
    llm = LLM(model=str(path), prefix_cache_dir=str(directory), **(MAKE | config))
    try:
        return [llm.generate([p], GREEDY)[0] for p in prompts], llm.engine.snapshot
    finally:
        llm.close()


@pytest.mark.parametrize("kv_cache_dtype", ["fp32", "q8_0"])
def test_a_restarted_engine_hits_the_saved_prefix_and_samples_the_same(tiny_checkpoint, tmp_path, kv_cache_dtype):
    path = tiny_checkpoint("qwen3")
    system = ids(70, seed=1)                  # 4 full blocks, the fifth partial
    first, snapshot = run(path, tmp_path, [system + ids(9, seed=2)], kv_cache_dtype=kv_cache_dtype)
    assert snapshot.path.exists() and first[0].cached_tokens == 0
    again, _ = run(path, tmp_path, [system + ids(9, seed=2), system + ids(12, seed=3)],
                   kv_cache_dtype=kv_cache_dtype)
    # both start with the saved system blocks (a prompt's last token is always fed)
    assert [c.cached_tokens for c in again] == [64, 64]
    cold = LLM(model=str(path), kv_cache_dtype=kv_cache_dtype, **MAKE)
    try:
        want = [cold.generate([p], GREEDY)[0].token_ids for p in (system + ids(9, seed=2), system + ids(12, seed=3))]
    finally:
        cold.close()
    assert [c.token_ids for c in again] == want


def test_a_draft_model_reads_a_restored_prefix_and_changes_no_token(tiny_checkpoint, tmp_path):
    """The file holds the target's K/V only: a self-draft reads the restored blocks itself before it
    proposes, so it proposes what the target draws."""
    path = tiny_checkpoint("qwen3")
    system = ids(70, seed=1)
    run(path, tmp_path, [system + ids(9, seed=2)])              # saved without a draft
    prompt = system + ids(12, seed=3)
    llm = LLM(model=str(path), prefix_cache_dir=str(tmp_path), draft_model=str(path), draft_quantization="none",
              **MAKE)
    try:
        llm.engine.draft.p_min = 0.0        # a random model is never sure: propose anyway
        [warm] = llm.generate([prompt], GREEDY)
        stats = llm.engine.scheduler.stats()
    finally:
        llm.close()
    [cold], _ = run(path, tmp_path / "cold", [prompt])
    assert warm.token_ids == cold.token_ids and warm.cached_tokens == 64
    # the same weights propose what the target draws, if the draft read the prefix (not zeros)
    assert stats.spec_proposed_tokens_total > 0
    assert stats.spec_accepted_tokens_total >= 0.9 * stats.spec_proposed_tokens_total


def test_another_layout_keeps_its_own_file_and_starts_cold(tiny_checkpoint, tmp_path):
    path = tiny_checkpoint("qwen3")
    prompt = ids(40, seed=5)
    _, fp32 = run(path, tmp_path, [prompt], kv_cache_dtype="fp32")
    [c], bf16 = run(path, tmp_path, [prompt], kv_cache_dtype="bf16")
    assert c.cached_tokens == 0 and bf16.path != fp32.path
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([fp32.path.name, bf16.path.name])


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_a_damaged_file_is_reported_and_the_engine_serves_cold(tiny_checkpoint, tmp_path, caplog, damage):
    path = tiny_checkpoint("qwen3")
    prompt = ids(40, seed=6)
    [want], snapshot = run(path, tmp_path, [prompt])
    data = snapshot.path.read_bytes()
    snapshot.path.write_bytes(data[:-100] if damage == "truncate" else b"not a cache" + data)
    with caplog.at_level(logging.WARNING, logger="pagedserve.engine"):
        [got], _ = run(path, tmp_path, [prompt])
    assert "not restored" in caplog.text
    assert got.cached_tokens == 0 and got.token_ids == want.token_ids
    [hit], _ = run(path, tmp_path, [prompt])         # the cold engine's save replaced the damaged file
    assert hit.cached_tokens == 32


ASK = dict(model="tiny-warm", max_tokens=4, temperature=0,
           messages=[{"role": "system", "content": "You review diffs. " * 10},
                     {"role": "user", "content": "Is this fine?"}])


def ask(srv: ServerProcess):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="none").chat.completions.create(**ASK)


def assert_warm(cold, warm) -> None:
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    assert warm.usage.prompt_tokens_details.cached_tokens == (cold.usage.prompt_tokens - 1) // 16 * 16 > 0
    assert warm.choices[0].message.content == cold.choices[0].message.content


def test_a_server_saves_when_its_terminal_closes_and_the_next_one_serves_from_the_file(
        tiny_checkpoint, tmp_path_factory, tmp_path):
    model = chat_model(tmp_path_factory, tiny_checkpoint, "tiny-warm", HERMES)
    replies, logs, shown = [], [], []
    for stop in (signal.SIGHUP, signal.SIGINT):
        srv = ServerProcess(model, "--prefix-cache-dir", str(tmp_path / "cache"), workdir=tmp_path)
        try:
            srv.wait_ready()
            shown.append(HttpClient(srv.url, "").connect(progress=lambda done, total: None))   # the console's header
            replies.append(ask(srv))
        finally:
            status = srv.stop(stop)         # closes the log
        logs.append((tmp_path / f"server-{srv.port}.log").read_text())
        assert status == 0, logs[-1]
    assert "prefix cache: saved" in logs[0], logs[0]
    # the second server computed nothing the file did not hold: it leaves the file as it is
    assert "prefix cache: restored" in logs[1] and "prefix cache: saved" not in logs[1], logs[1]
    assert_warm(*replies)
    restored = 16 * int(re.search(r"saved (\d+) blocks", logs[0])[1])
    assert "cached tokens restored" not in shown[0] and shown[1].endswith(f" · {restored:,} cached tokens restored")


def test_a_killed_server_comes_back_warm_from_its_idle_save(tiny_checkpoint, tmp_path_factory, tmp_path):
    model = chat_model(tmp_path_factory, tiny_checkpoint, "tiny-warm", HERMES)
    cache = ["--prefix-cache-dir", str(tmp_path / "cache")]
    srv = ServerProcess(model, *cache, "--prefix-cache-save-interval-s", "0.1", workdir=tmp_path)
    try:
        srv.wait_ready()
        cold = ask(srv)
        log, deadline = tmp_path / f"server-{srv.port}.log", time.monotonic() + 60
        while "prefix cache: saved" not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        srv.stop(signal.SIGKILL)            # no clean stop: only the idle save kept anything
    with ServerProcess(model, *cache, workdir=tmp_path) as srv:
        assert_warm(cold, ask(srv))


def test_an_idle_save_waits_its_interval_and_stops_for_a_request(tmp_path):
    bs, dims = 4, (3, 5)
    cache, pools = PrefixCache(bs), [torch.randn(16, bs, *dims), torch.randn(16, bs, *dims)]
    allocator = BlockAllocator(16, cache)
    snapshot = KVSnapshot(str(tmp_path), {"t": 1}, allocator, pools, interval_s=0.05)
    snapshot.save_when_idle(lambda: False)
    assert not snapshot.path.exists()           # nothing cached yet
    chains(cache, allocator, [ids(8, seed=1)])
    snapshot.save_when_idle(lambda: False)
    assert not snapshot.path.exists()           # the interval has not passed since the engine started
    time.sleep(0.06)
    answers = iter([False, True])               # a request comes after the first pool's blocks
    snapshot.save_when_idle(lambda: next(answers))
    assert list(tmp_path.iterdir()) == [] and snapshot.changed
    snapshot.save_when_idle(lambda: False)      # the next idle moment
    snapshot.wait()
    assert snapshot.path.exists() and not snapshot.changed
    written = snapshot.path.stat().st_ino
    time.sleep(0.06)
    snapshot.save_when_idle(lambda: False)      # unchanged: not written again
    snapshot.wait()
    assert snapshot.path.stat().st_ino == written
    back = [torch.zeros_like(p) for p in pools]
    restored = BlockAllocator(16, PrefixCache(bs))
    assert KVSnapshot(str(tmp_path), {"t": 1}, restored, back).load() == 2
    for b, e in restored.cache.entries():
        src = next(a for a, f in cache.entries() if f == e)
        assert all(torch.equal(x[b], p[src]) for x, p in zip(back, pools))
    never = KVSnapshot(str(tmp_path / "never"), {"t": 1}, allocator, pools)    # interval 0
    time.sleep(0.01)
    never.save_when_idle(lambda: False)
    assert not never.path.exists()


def test_an_idle_save_that_fails_is_reported_and_tried_again_after_its_interval(tmp_path, caplog):
    cache, pool = PrefixCache(4), torch.randn(16, 4, 3, 5)
    allocator = BlockAllocator(16, cache)
    snapshot = KVSnapshot(str(tmp_path / "cache"), {"t": 1}, allocator, [pool], interval_s=0.05)
    (tmp_path / "cache").write_text("")         # the directory became a file
    chains(cache, allocator, [ids(8, seed=1)])
    time.sleep(0.06)
    with caplog.at_level(logging.WARNING, logger="pagedserve.engine"):
        snapshot.save_when_idle(lambda: False)
    assert "not saved" in caplog.text and snapshot.changed
    (tmp_path / "cache").unlink()
    snapshot.save_when_idle(lambda: False)      # within the interval of the failed try: not yet
    assert not snapshot.path.exists()
    time.sleep(0.06)
    snapshot.save_when_idle(lambda: False)
    snapshot.wait()
    assert snapshot.path.exists() and not snapshot.changed


def test_an_idle_save_that_raises_leaves_the_loop_serving(tiny_checkpoint, tmp_path, monkeypatch, caplog):
    def broken(*args):
        raise RuntimeError("device lost")
    llm = LLM(model=str(tiny_checkpoint("qwen3")), prefix_cache_dir=str(tmp_path), prefix_cache_save_interval_s=1e-6,
              **MAKE)
    client = EngineClient(llm.engine)       # the loop on its own thread, as a server runs it
    try:
        with monkeypatch.context() as m, caplog.at_level(logging.WARNING, logger="pagedserve.engine"):
            m.setattr(KVSnapshot, "_write", broken)
            first = client.submit(ids(40, seed=12), params=GREEDY).result()
            deadline = time.monotonic() + 30
            while "device lost" not in caplog.text and time.monotonic() < deadline:
                time.sleep(0.01)
        assert "not saved" in caplog.text and "device lost" in caplog.text
        again = client.submit(ids(40, seed=12), params=GREEDY).result()   # the loop goes on, and saves now
        assert again.token_ids == first.token_ids
    finally:
        client.close()
    assert llm.engine.snapshot.path.exists()


def test_a_directory_that_cannot_be_made_fails_the_start_and_a_failed_save_keeps_serving(tiny_checkpoint, tmp_path,
                                                                                          caplog):
    path = tiny_checkpoint("qwen3")
    blocked = tmp_path / "file"
    blocked.write_text("")
    with pytest.raises(ConfigError, match="prefix_cache_dir = .*file/cache"):
        LLM(model=str(path), prefix_cache_dir=str(blocked / "cache"), **MAKE)
    llm = LLM(model=str(path), prefix_cache_dir=str(tmp_path / "cache"), **MAKE)
    llm.generate([ids(40, seed=11)], GREEDY)
    (tmp_path / "cache").rmdir()
    (tmp_path / "cache").write_text("")       # the directory is gone when the engine stops
    with caplog.at_level(logging.WARNING, logger="pagedserve.engine"):
        llm.close()
    assert "not saved" in caplog.text


def test_the_code_identity_follows_the_kv_sources_only(tmp_path):
    (tmp_path / "ops" / "cpu").mkdir(parents=True)
    (tmp_path / "server").mkdir()
    kernel, route = tmp_path / "ops" / "cpu" / "kv.h", tmp_path / "server" / "routes.py"
    kernel.write_text("int tile = 16;")
    route.write_text("x = 1")
    first = code_identity(tmp_path, ("ops",))
    route.write_text("x = 2")
    (tmp_path / "ops" / "notes.txt").write_text("not code")
    assert code_identity(tmp_path, ("ops",)) == first
    kernel.write_text("int tile = 32;")
    assert code_identity(tmp_path, ("ops",)) != first


def test_a_save_removes_this_models_files_from_other_code_only(tmp_path):
    def saved(**fingerprint):
        snapshot = KVSnapshot(str(tmp_path), fingerprint, BlockAllocator(2, PrefixCache(4)), [torch.zeros(2, 4, 8)])
        snapshot.save()
        return snapshot.path

    old_code, other_model = saved(model="a", code="1"), saved(model="b", code="1")
    junk = tmp_path / "junk.kv"
    junk.write_bytes(b"not a cache")
    new_code = KVSnapshot(str(tmp_path), dict(model="a", code="2", torch="9"), BlockAllocator(2, PrefixCache(4)),
                          []).path
    # temporary files of saves: one a killed process left, one a live process is writing
    dead = subprocess.Popen(["true"])
    dead.wait()
    killed, live = temp_path(new_code), temp_path(new_code)
    killed = killed.with_name(killed.name.replace(f".{os.getpid()}-", f".{dead.pid}-"))
    killed.write_bytes(b"half")
    live.write_bytes(b"half")
    assert saved(model="a", code="2", torch="9") == new_code
    assert sorted(tmp_path.iterdir()) == sorted([other_model, junk, new_code, live]) and not old_code.exists()


def test_an_idle_save_does_not_wait_for_the_last_ones_sync(tmp_path, monkeypatch):
    cache, pool = PrefixCache(4), torch.randn(16, 4, 3, 5)
    allocator = BlockAllocator(16, cache)
    snapshot = KVSnapshot(str(tmp_path), {"t": 1}, allocator, [pool], interval_s=0.01)
    release, fsync = threading.Event(), os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (release.wait(30), fsync(fd)))   # a slow disk
    chains(cache, allocator, [ids(8, seed=1)])
    time.sleep(0.02)
    snapshot.save_when_idle(lambda: False)          # written; its sync holds
    chains(cache, allocator, [ids(8, seed=2)])
    time.sleep(0.02)
    snapshot.save_when_idle(lambda: False)          # returns at once: no second file is begun
    assert len(list(tmp_path.iterdir())) == 1 and not snapshot.path.exists()
    release.set()
    snapshot.wait()
    assert snapshot.path.exists() and snapshot.changed      # the second prompt's blocks are not in it
    time.sleep(0.02)
    snapshot.save_when_idle(lambda: False)
    snapshot.wait()
    assert not snapshot.changed


def chains(cache: PrefixCache, allocator: BlockAllocator, prompts: list[list[int]]) -> None:
    """Index each prompt's full blocks as computed, then let them go (as a finished request does)."""
    for tokens in prompts:
        chain = cache.chain()
        hashes = chain.extend(tokens)
        handles = allocator.allocate(len(hashes))
        for i, h in enumerate(handles):
            cache.insert(h.block_id, chain, i, tokens)
        allocator.free(reversed(handles))


def test_a_smaller_pool_keeps_the_newest_blocks_with_their_parents(tmp_path):
    bs, dims = 4, (3, 5)
    cache, pool = PrefixCache(bs), torch.randn(32, bs, *dims)
    allocator = BlockAllocator(32, cache)
    old, new = ids(12, seed=7), ids(8, seed=8) + ids(8, seed=9)
    chains(cache, allocator, [old, new])     # 3 blocks, then 4 newer ones
    saved = {e.hash: pool[b].clone() for b, e in cache.entries()}
    KVSnapshot(str(tmp_path), {"t": 1}, allocator, [pool]).save()

    small_cache, small = PrefixCache(bs), torch.zeros(5, bs, *dims)
    small_alloc = BlockAllocator(5, small_cache)
    assert KVSnapshot(str(tmp_path), {"t": 1}, small_alloc, [small]).load() == 5
    hit_new = small_cache.lookup(new, small_cache.chain().extend(new))
    hit_old = small_cache.lookup(old, small_cache.chain().extend(old))
    assert len(hit_new) == 4 and len(hit_old) == 1     # the newer chain whole, then the older's head
    for b, e in small_cache.entries():
        assert torch.equal(small[b], saved[e.hash])
    assert small_alloc.num_free == 5 and small_cache.num_idle == 5
    # the older chain's head was used least recently: it goes first
    assert small_alloc.allocate(1)[0].block_id == hit_old[0]
    # another fingerprint finds no file of its own
    assert KVSnapshot(str(tmp_path), {"t": 2}, BlockAllocator(5, PrefixCache(bs)), [small]).load() == 0
    empty = KVSnapshot(str(tmp_path), {"t": 3}, BlockAllocator(5, PrefixCache(bs)), [small])
    assert empty.save() == 0 and empty.path.exists() and empty.load() == 0


def test_orphans_and_the_budget_decide_what_is_kept():
    cache = PrefixCache(2)
    chain = cache.chain()
    hashes = chain.extend([1, 2, 3, 4, 5, 6])
    entries = [Entry(hashes[i], chain.parent_of(i), ()) for i in range(3)]
    orphan = Entry(b"x" * 16, b"y" * 16, ())
    # most recently used first: the chain's tail, an orphan, the head
    order = [entries[2], orphan, entries[0], entries[1]]
    assert closed_prefix(order, cache.root, 10) == [2, 3, 0]
    assert closed_prefix(order, cache.root, 2) == []          # the tail needs all 3
    looped = [Entry(b"a" * 16, b"b" * 16, ()), Entry(b"b" * 16, b"a" * 16, ())]
    assert closed_prefix(looped, cache.root, 10) == []
