"""`make gpu-check`: the GPU path end to end, on a machine with an NVIDIA or AMD GPU.

1. the Triton kernel tests (tests/test_triton_kernels.py) with the kernels on the GPU;
2. a tiny random Qwen3 model: one mixed prefill+decode step under torch.compile(fullgraph=True) with the
   kernels exposed to inductor, and decode steps replayed from CUDA graphs, both against eager; then the
   engine's greedy tokens with the runner's CUDA graphs against the engine without them;
3. decode throughput of a Qwen3-0.6B-shaped random model at concurrency 1, 16 and 64: tok/s and the
   fraction of the GPU's bandwidth roofline (weights + K/V read per step / measured copy bandwidth).
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from engine.cuda_graphs import DecodeGraphs  # noqa: E402
from engine.kv.pool import KVPool, KVShape  # noqa: E402
from engine.loading.checkpoint import open_checkpoint  # noqa: E402
from engine.loading.model_config import parse_model_config  # noqa: E402
from engine.models.batch import ForwardBatch  # noqa: E402
from engine.models.qwen3 import DenseDecoder  # noqa: E402

BLOCK = 16
QWEN3_0_6B = dict(hidden=1024, layers=28, heads=16, kv_heads=8, head_dim=128, intermediate=3072, vocab=151936,
                  max_pos=4096)


def kernel_tests() -> None:
    env = {**os.environ, "PAGEDSERVE_TEST_DEVICE": "cuda"}
    env.pop("TRITON_INTERPRET", None)
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "tests/test_triton_kernels.py"], cwd=ROOT, env=env)
    if result.returncode:
        sys.exit(f"gpu-check: the Triton kernel tests failed on the GPU (exit {result.returncode})")


def load_model(directory: Path, dtype: torch.dtype, device: torch.device, **sizes) -> DenseDecoder:
    from tiny_models import make_checkpoint   # test helper: random HF-format checkpoint
    ckpt = open_checkpoint(make_checkpoint(directory, "qwen3", tied=True, **sizes))
    return DenseDecoder(parse_model_config(ckpt.config), ckpt, dtype, device)


def decode_batch(contexts: list[int], device: torch.device, vocab: int, width: int) -> ForwardBatch:
    """One decode token per row; row i owns blocks i*width .. i*width + width - 1."""
    rows = len(contexts)
    tables = torch.arange(rows * width, dtype=torch.int32).view(rows, width)
    positions = torch.tensor([c - 1 for c in contexts])
    return ForwardBatch(
        input_ids=torch.randint(0, vocab, (rows,)).to(device), positions=positions.to(device),
        slot_mapping=(tables[torch.arange(rows), positions // BLOCK].long() * BLOCK + positions % BLOCK).to(device),
        block_tables=tables.to(device), query_start_loc=torch.arange(rows + 1, dtype=torch.int32).to(device),
        context_lens=torch.tensor(contexts, dtype=torch.int32).to(device),
        logits_indices=torch.arange(rows).to(device))


def mixed_batch(device: torch.device, vocab: int) -> ForwardBatch:
    """A 20-token prompt chunk after 13 cached tokens, next to two decode rows (uses blocks 0..8)."""
    lens, starts, tables = [20, 1, 1], [13, 40, 7], [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    positions = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lens)])
    row_of = torch.repeat_interleave(torch.arange(3), torch.tensor(lens))
    table = torch.tensor(tables, dtype=torch.int32)
    qsl = torch.tensor([0, 20, 21, 22], dtype=torch.int32)
    return ForwardBatch(
        input_ids=torch.randint(0, vocab, (22,)).to(device), positions=positions.to(device),
        slot_mapping=(table[row_of, positions // BLOCK].long() * BLOCK + positions % BLOCK).to(device),
        block_tables=table.to(device), query_start_loc=qsl.to(device),
        context_lens=torch.tensor([s + n for s, n in zip(starts, lens)], dtype=torch.int32).to(device),
        logits_indices=(qsl[1:] - 1).long().to(device))


def compiled_and_graphed_match_eager(device: torch.device) -> None:
    from ops.triton import expose_to_inductor
    expose_to_inductor()
    with tempfile.TemporaryDirectory() as tmp, torch.inference_mode():
        model = load_model(Path(tmp), torch.float32, device)
        cfg = model.cfg
        shape = KVShape(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, BLOCK, torch.float32)
        batch = mixed_batch(device, cfg.vocab_size)
        cached = KVPool(shape, 16, device)            # the rows' cached prefixes: random K/V
        for k, v in cached.layers:
            k.normal_()
            v.normal_()
        results = []
        for forward in (model.forward, torch.compile(model.forward, fullgraph=True)):
            layers = [(k.clone(), v.clone()) for k, v in cached.layers]
            results.append(model.logits(forward(batch, layers)))
        torch.testing.assert_close(results[1], results[0], atol=2e-4, rtol=2e-4)
        print("compiled mixed step == eager (fp32, max |diff| "
              f"{(results[1] - results[0]).abs().max().item():.2e})")

        graphs = DecodeGraphs(model.forward)
        decode = decode_batch([5, 17, 33], device, cfg.vocab_size, width=3)
        eager_pool, graph_pool = KVPool(shape, 16, device), KVPool(shape, 16, device)
        for _ in range(3):                            # capture, then replays: K/V must advance identically
            eager = model.logits(model.forward(decode, eager_pool.layers))
            graphed = model.logits(graphs.run(decode, graph_pool.layers))
            torch.testing.assert_close(graphed, eager, atol=2e-4, rtol=2e-4)
            decode.positions += 1
            decode.context_lens += 1
            decode.slot_mapping += 1
        print(f"CUDA-graph decode steps == eager ({len(graphs.graphs)} graph captured)")


def engine_graphs_match_eager() -> None:
    """The engine end to end: decode steps from the runner's CUDA graphs give the eager engine's tokens."""
    from engine import LLM, SamplingParams
    from tiny_models import make_checkpoint
    with tempfile.TemporaryDirectory() as tmp:
        path = str(make_checkpoint(Path(tmp), "qwen3", tied=True))
        prompts = [list(range(5, 25)), list(range(40, 47)), list(range(60, 63))]
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        kw = dict(device="cuda", dtype="float32", max_model_len=128, kv_pool_tokens=1024)
        eager = LLM(model=path, cuda_graphs=False, **kw).generate(prompts, params)
        llm = LLM(model=path, **kw)
        graphed = llm.generate(prompts, params)
        if [o.token_ids for o in graphed] != [o.token_ids for o in eager]:
            sys.exit("gpu-check: the engine's CUDA-graph decode steps gave other tokens than eager steps")
        print(f"engine: decode steps from {len(llm.engine.runner.graphs.graphs)} CUDA graphs give the eager tokens")


def copy_bandwidth(device: torch.device) -> float:
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(10):
        dst.copy_(src)
    torch.cuda.synchronize()
    return 2 * src.numel() * 10 / (time.perf_counter() - start)     # read + write bytes per second


def throughput(device: torch.device, context: int = 512, steps: int = 50) -> None:
    from ops.triton import expose_to_inductor
    expose_to_inductor()
    bandwidth = copy_bandwidth(device)
    print(f"copy bandwidth {bandwidth / 1e9:.0f} GB/s")
    with tempfile.TemporaryDirectory() as tmp, torch.inference_mode():
        model = load_model(Path(tmp), torch.bfloat16, device, **QWEN3_0_6B)
        cfg = model.cfg
        width = -(-(context + steps) // BLOCK)
        graphs = DecodeGraphs(torch.compile(model.forward, fullgraph=True))
        for rows in (1, 16, 64):
            pool = KVPool(KVShape(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, BLOCK, torch.bfloat16),
                          rows * width, device)
            batch = decode_batch([context] * rows, device, cfg.vocab_size, width)
            graphs.run(batch, pool.layers)            # capture outside the timing
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(steps):
                model.logits(graphs.run(batch, pool.layers)).argmax(-1)
            torch.cuda.synchronize()
            step = (time.perf_counter() - start) / steps
            kv_bytes = rows * context * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 2
            fraction = (model.weight_bytes + kv_bytes) / step / bandwidth
            print(f"concurrency {rows:3d}: {rows / step:9.0f} tok/s, {step * 1e3:6.2f} ms/step, "
                  f"{fraction:5.1%} of the bandwidth roofline (context {context})")


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("no CUDA device: gpu-check needs an NVIDIA or AMD GPU")
    device = torch.device("cuda")
    print(f"gpu-check on {torch.cuda.get_device_name(device)}")
    kernel_tests()
    compiled_and_graphed_match_eager(device)
    engine_graphs_match_eager()
    throughput(device)


if __name__ == "__main__":
    main()
