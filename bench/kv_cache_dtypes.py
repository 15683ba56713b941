"""K/V cache dtypes on the default model: single-stream decode speed after long contexts next to the
bandwidth roofline of the bytes a step reads (weights + K/V, probe measured in the same run) and the share
of it attention reaches (the contexts decoded in turn, `--rounds` times), and
fidelity against fp32 K/V — greedy agreement over a code reply and the per-token log-likelihood
(perplexity) of a fixed text; the aggregate decode rate of several streams after a shared long
prompt (llama-batched-bench -pps does the same); the time to prefill a fresh long prompt. Also how many
8k-token sessions a GiB of pool holds.

    .venv/bin/python bench/kv_cache_dtypes.py speed --dtypes bf16 q8_0 q4_0 --contexts 128 4096 8192 16384
    .venv/bin/python bench/kv_cache_dtypes.py fidelity --dtypes bf16 fp16 q8_0 q4_0 --dtype float32
    .venv/bin/python bench/kv_cache_dtypes.py streams --streams 8 --contexts 4096 --tokens 64
    .venv/bin/python bench/kv_cache_dtypes.py prefill --dtypes bf16 --contexts 8192 --rounds 2
"""
from __future__ import annotations

import argparse
import gc
import math
import statistics
import sys
import textwrap
import time
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent))

from engine import LLM, SamplingParams  # noqa: E402
from engine.models.batch import ForwardBatch  # noqa: E402
from roofline import measure_machine  # noqa: E402

CODE_PROMPT = [{"role": "user", "content": "Write a Python class LRUCache with get and put in O(1), "
                                           "type hints, docstrings and a few unit tests."}]
SESSION = 8192


def _engine(args, kv_dtype: str, tokens: int, streams: int = 1) -> LLM:
    # speculative off: the figures are plain decode steps'
    return LLM(model=args.model, dtype=args.dtype, kv_cache_dtype=kv_dtype, max_concurrency=streams,
               max_model_len=tokens + args.tokens + 64, kv_pool_tokens=tokens + streams * (args.tokens + 128),
               speculative="none")


def speed(args) -> None:
    machine = measure_machine()
    print(f"probe: {machine.bandwidth_gb_s:.1f} GB/s")
    longest = max(args.contexts)
    prompt = [(i * 7919) % 30000 + 100 for i in range(longest)]
    for dtype in args.dtypes:
        llm = _engine(args, dtype, longest)
        engine = llm.engine
        llm.generate([prompt[-64:]], SamplingParams(max_tokens=4))       # warm-up
        per_token = engine.pool.shape.bytes_per_block / engine.pool.shape.block_size
        weights = engine.model.weight_bytes
        sessions = (1 << 30) / (per_token * SESSION)
        print(f"{dtype}: K/V {per_token / 1024:.1f} KiB per token, {sessions:.2f} sessions of {SESSION:,} "
              f"tokens per GiB of pool; weights {weights / 2**20:.0f} MiB")
        gaps = {ctx: [] for ctx in sorted(args.contexts)}
        for _ in range(args.rounds):       # contexts in turn, so a drift in the machine's load hits all
            for ctx in gaps:               # each prompt extends the last: the prefix cache holds it
                handle = engine.loop.submit(prompt[:ctx], SamplingParams(temperature=0, max_tokens=args.tokens,
                                                                         ignore_eos=True), bounded=False)
                engine.loop.run_until_idle()
                times = [t for d in handle for t in d.token_times]
                gaps[ctx] += [b - a for a, b in zip(times, times[1:])]
        step = {ctx: statistics.median(g) for ctx, g in gaps.items()}
        first = min(step)
        for ctx, s in step.items():
            roof = machine.decode_step_s(weight_bytes=weights, kv_bytes=int(per_token * ctx))
            # attention against its share of the bandwidth: the extra K/V bytes over the shortest context's
            # at the probe's rate, over the extra time its steps took (the rest of a step is the same)
            kv_s = machine.decode_step_s(weight_bytes=0, kv_bytes=int(per_token * (ctx - first)))
            share = f", attention {kv_s / (s - step[first]):4.0%} of its bandwidth share" if s > step[first] else ""
            print(f"  context {ctx:6,}: {1 / s:5.1f} tok/s ({step[first] / s:4.0%} of {first:,}), roofline "
                  f"{1 / roof:5.1f} tok/s ({roof / s:4.0%} of it){share}", flush=True)
        del llm, engine
        gc.collect()


def streams(args) -> None:
    """Generated tokens over the time from the last stream's first token to the end."""
    for dtype in args.dtypes:
        for ctx in args.contexts:
            llm = _engine(args, dtype, ctx, args.streams)
            prompt = [(i * 7919) % 30000 + 100 for i in range(ctx)]
            llm.generate([prompt[-64:]], SamplingParams(max_tokens=4))       # warm-up
            loop = llm.engine.loop
            params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
            handles = [loop.submit(prompt, params, bounded=False) for _ in range(args.streams)]
            loop.run_until_idle()
            times = [[t for d in h for t in d.token_times] for h in handles]
            start, end = max(t[0] for t in times), max(t[-1] for t in times)
            tokens = sum(sum(start < x <= end for x in t) for t in times)
            print(f"{dtype}: {args.streams} streams after {ctx:,} shared tokens: {tokens / (end - start):.1f} "
                  f"tok/s aggregate decode", flush=True)
            del llm
            gc.collect()


def prefill(args) -> None:
    """Seconds from submitting a fresh prompt (nothing of it cached) to its first token, `rounds` prompts
    per context."""
    for dtype in args.dtypes:
        llm = _engine(args, dtype, max(args.contexts))
        llm.generate([[101, 102, 103] * 20], SamplingParams(max_tokens=2))      # warm-up
        for ctx in sorted(args.contexts):
            for r in range(args.rounds):
                prompt = [(i * 7919 + 31 * (r + 1) + ctx) % 30000 + 100 for i in range(ctx)]
                start = time.perf_counter()
                llm.generate([prompt], SamplingParams(max_tokens=1))
                took = time.perf_counter() - start
                print(f"{dtype}: {ctx:,} fresh tokens to the first token in {took:.1f} s ({ctx / took:.0f} tok/s)",
                      flush=True)
        del llm
        gc.collect()


def token_logprobs(engine, ids: list[int], chunk: int = 512) -> list[float]:
    """log p(ids[i+1] | ids[:i+1]) for every i, teacher-forced through the engine's model and pool
    (blocks 0.. of an idle pool)."""
    bs = engine.pool.shape.block_size
    table = torch.arange(-(-len(ids) // bs), dtype=torch.int32)[None]
    out = []
    with torch.inference_mode():
        for s in range(0, len(ids) - 1, chunk):
            e = min(s + chunk, len(ids) - 1)
            pos = torch.arange(s, e)
            batch = ForwardBatch(input_ids=torch.tensor(ids[s:e]), positions=pos, slot_mapping=pos.clone(),
                                 block_tables=table, query_start_loc=torch.tensor([0, e - s], dtype=torch.int32),
                                 context_lens=torch.tensor([e], dtype=torch.int32), logits_indices=torch.arange(e - s))
            logp = engine.model.logits(engine.model.forward(batch, engine.pool.layers)).log_softmax(-1)
            out += logp[torch.arange(e - s), torch.tensor(ids[s + 1:e + 1])].tolist()
    return out


def fidelity(args) -> None:
    text = Path(textwrap.__file__).read_text()
    results = {}
    for dtype in ["fp32", *args.dtypes]:
        llm = _engine(args, dtype, 4096)
        ids = llm.tokenizer.encode(text)[:args.text_tokens]
        reply = llm.chat(CODE_PROMPT, SamplingParams(temperature=0, max_tokens=args.reply_tokens,
                                                     ignore_eos=True)).token_ids
        logps = token_logprobs(llm.engine, ids)
        results[dtype] = reply, logps
        ref_reply, ref_logps = results["fp32"]
        same = next((i for i, (a, b) in enumerate(zip(reply, ref_reply)) if a != b), len(reply))
        agree = sum(a == b for a, b in zip(reply, ref_reply)) / len(reply)
        nll = -sum(logps) / len(logps)
        delta = max(abs(a - b) for a, b in zip(logps, ref_logps))
        print(f"{dtype:5s}: reply identical to fp32 K/V for {same}/{len(reply)} tokens ({agree:.0%} of positions "
              f"equal); perplexity {math.exp(nll):.4f} over {len(logps)} tokens (fp32 K/V "
              f"{math.exp(-sum(ref_logps) / len(ref_logps)):.4f}), largest per-token log-likelihood change "
              f"{delta:.4f}", flush=True)
        del llm
        gc.collect()


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("part", choices=["speed", "fidelity", "streams", "prefill"])
    p.add_argument("--model", default="qwen2.5-coder-1.5b")
    p.add_argument("--dtype", default="auto", help="activations (fidelity: float32 isolates the K/V's rounding)")
    p.add_argument("--dtypes", nargs="+", default=["bf16", "q8_0", "q4_0"])
    p.add_argument("--contexts", type=int, nargs="+", default=[128, 4096, 8192, 16384])
    p.add_argument("--tokens", type=int, default=33, help="decoded per context (speed)")
    p.add_argument("--reply-tokens", type=int, default=256)
    p.add_argument("--text-tokens", type=int, default=2000)
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--rounds", type=int, default=2,
                   help="fresh prompts per context (prefill); passes over the contexts in turn (speed)")
    args = p.parse_args(argv)
    {"speed": speed, "fidelity": fidelity, "streams": streams, "prefill": prefill}[args.part](args)


if __name__ == "__main__":
    main(sys.argv[1:])
