"""K/V pool sizing (engine/kv/pool.py): a CPU pool holds what the configured concurrency needs, within
a share of free memory; a GPU pool takes what free memory allows; pool memory is committed as used; the
storage dtype (kv_cache_dtype) sizes it."""
from __future__ import annotations

import psutil
import pytest
import torch

from engine.kv import pool as pool_module
from dataclasses import replace

from engine.kv.pool import (KVCacheDtypeError, KVPool, KVShape, PoolSizeError, lazy_zeros, plan_num_blocks,
                            resolve_kv_cache_dtype)

SHAPE = KVShape(num_layers=28, kv_heads=2, head_dim=128, block_size=16, dtype=torch.float32)  # 1.5B-like
CPU, GPU = torch.device("cpu"), torch.device("cuda")


def _free(monkeypatch, gib: float) -> None:
    monkeypatch.setattr(pool_module, "available_bytes", lambda device: int(gib * 2**30))


def test_a_cpu_pool_holds_the_configured_concurrency_of_default_contexts(monkeypatch):
    _free(monkeypatch, 64)
    # 8 sequences of 8,192 tokens (+ a spare block each), however long the model's context is
    assert plan_num_blocks(SHAPE, kv_pool_tokens=0, max_concurrency=8, max_model_len=32768,
                           device=CPU) == 8 * (8192 // 16 + 1)
    assert plan_num_blocks(SHAPE, kv_pool_tokens=0, max_concurrency=8, max_model_len=1024,
                           device=CPU) == 8 * (1024 // 16 + 1)
    # one full-length sequence at the least
    assert plan_num_blocks(SHAPE, kv_pool_tokens=0, max_concurrency=1, max_model_len=32768,
                           device=CPU) == 32768 // 16 + 1


def test_a_cpu_pool_stays_within_half_the_free_memory(monkeypatch):
    _free(monkeypatch, 2)
    blocks = plan_num_blocks(SHAPE, kv_pool_tokens=0, max_concurrency=64, max_model_len=4096, device=CPU)
    assert blocks == 2**30 // SHAPE.bytes_per_block
    _free(monkeypatch, 0.1)
    with pytest.raises(PoolSizeError, match="cannot hold one sequence of max_model_len = 4,096"):
        plan_num_blocks(SHAPE, kv_pool_tokens=0, max_concurrency=8, max_model_len=4096, device=CPU)


def test_a_gpu_pool_takes_what_free_memory_allows(monkeypatch):
    _free(monkeypatch, 10)
    usable = 10 * 2**30 - 2**30           # less the reserve: a tenth, at least 1 GiB
    assert plan_num_blocks(SHAPE, kv_pool_tokens=0, max_concurrency=10**6, max_model_len=4096,
                           device=GPU) == usable // SHAPE.bytes_per_block


def test_the_user_sets_the_size_whatever_the_memory(monkeypatch):
    _free(monkeypatch, 0.001)
    assert plan_num_blocks(SHAPE, kv_pool_tokens=5000, max_concurrency=8, max_model_len=1024,
                           device=CPU) == -(-5000 // 16)


def test_pool_memory_is_committed_only_as_it_is_written():
    rss = psutil.Process().memory_info().rss
    k = lazy_zeros((2048, 16, 8, 128), torch.bfloat16, CPU)          # 64 MiB
    v = lazy_zeros((2048, 16, 8, 128), torch.float32, CPU)           # 128 MiB
    assert psutil.Process().memory_info().rss - rss < 16 * 2**20
    assert k.data_ptr() % 64 == 0 and v.data_ptr() % 64 == 0 and k.is_contiguous()
    assert (k.dtype, tuple(v.shape)) == (torch.bfloat16, (2048, 16, 8, 128))
    assert not k[::97].any() and not v[::97].any()
    v[:64] = 1.0
    assert v[:64].all() and not v[64:128].any()


def test_a_16_bit_pool_holds_twice_the_tokens_in_the_same_memory(monkeypatch):
    _free(monkeypatch, 2)
    half = replace(SHAPE, dtype=torch.bfloat16)
    assert half.bytes_per_block * 2 == SHAPE.bytes_per_block
    wide = plan_num_blocks(SHAPE, kv_pool_tokens=0, max_concurrency=64, max_model_len=4096, device=CPU)
    narrow = plan_num_blocks(half, kv_pool_tokens=0, max_concurrency=64, max_model_len=4096, device=CPU)
    assert narrow == 2 * wide
    pool = KVPool(replace(SHAPE, num_layers=2, dtype=torch.float16), 4, CPU)
    assert {t.dtype for layer in pool.layers for t in layer} == {torch.float16}
    assert pool.nbytes == 2 * 2 * 4 * 16 * 2 * 128 * 2


def test_kv_cache_dtype_names():
    # auto: a 16-bit cache on CPUs whatever the activations; the model's dtype on GPUs
    assert resolve_kv_cache_dtype("auto", CPU, torch.float32) == torch.bfloat16
    assert resolve_kv_cache_dtype("auto", CPU, torch.bfloat16) == torch.bfloat16
    assert resolve_kv_cache_dtype("auto", GPU, torch.float16) == torch.float16
    assert resolve_kv_cache_dtype("model", CPU, torch.float32) == torch.float32
    assert [resolve_kv_cache_dtype(n, CPU, torch.float32) for n in ("bf16", "fp16", "fp32")] == [
        torch.bfloat16, torch.float16, torch.float32]
    assert [resolve_kv_cache_dtype(n, CPU, torch.float32) for n in ("q8_0", "q4_0")] == ["q8_0", "q4_0"]
    with pytest.raises(KVCacheDtypeError, match='kv_cache_dtype = .q3_k.: allowed are "auto", "model", "bf16", '
                                                '"fp16", "fp32", "q8_0", "q4_0"'):
        resolve_kv_cache_dtype("q3_k", CPU, torch.float32)
