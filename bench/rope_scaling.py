"""Serving past a model's trained context with rope scaling (`rope_scaling` / `rope_scale`), on the default
model, whose config trains it to 32,768 positions: the perplexity of this repository's own code in windows
deep into one long text, with and without the scaling (static YaRN changes short contexts too), next to each
window's after only the 2,000 tokens before it; and whether the model finds a fact hidden in such a text at
a few depths (needle in a haystack).

    .venv/bin/python bench/rope_scaling.py perplexity --tokens 40000 --windows 0 30000 38000
    .venv/bin/python bench/rope_scaling.py needle --contexts 40000 --depths 0.25 0.5 0.75

A window past the trained context runs only with the scaling: without it the engine refuses those positions.
"""
from __future__ import annotations

import argparse
import gc
import math
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent))

from engine import LLM, SamplingParams  # noqa: E402
from kv_cache_dtypes import token_logprobs  # noqa: E402

SOURCES = ("engine", "server", "console", "ops")
PASSWORD = "tangerine-4817"
NEEDLE = f"\n# Note for whoever deploys this: the staging password is {PASSWORD}.\n"
QUESTION = "What is the staging password mentioned in the code above? Answer with the password only."


def _engine(args, scaled: bool, tokens: int) -> LLM:
    keys = dict(rope_scaling="yarn", rope_scale=args.scale) if scaled else {}
    return LLM(model=args.model, max_concurrency=1, max_model_len=tokens + 64, kv_pool_tokens=tokens + 256, **keys)


def code_text() -> str:
    """The project's Python sources, one after another, each headed by its path."""
    files = sorted(p for d in SOURCES for p in (BENCH.parent / d).rglob("*.py"))
    return "".join(f"\n# ---- {p.relative_to(BENCH.parent)}\n{p.read_text()}" for p in files)


def perplexity(args) -> None:
    """Per window: its perplexity after everything before it (plain rotary as far as it serves, then yarn),
    and after only `--window` tokens of plain rotary, which every window fits (what its text alone gives)."""
    def ppl(logps: list[float]) -> str:
        return f"{math.exp(-sum(logps) / len(logps)):.3f}"

    for scaled in (False, True):
        longest = args.tokens if scaled else min(args.tokens, args.trained - 64)
        llm = _engine(args, scaled, longest)
        ids = llm.tokenizer.encode(code_text())[:args.tokens]
        assert len(ids) == args.tokens, f"the sources hold {len(ids):,} tokens, fewer than {args.tokens:,}"
        started = time.perf_counter()
        logps = token_logprobs(llm.engine, ids[:longest])
        label = f"yarn x{args.scale:g}" if scaled else "plain rotary"
        windows = [w for w in args.windows if w + args.window <= longest]
        print(f"{label}: {longest:,} tokens teacher-forced in {time.perf_counter() - started:.0f} s; perplexity " +
              ", ".join(f"{ppl(logps[w:w + args.window])} at [{w:,}, {w + args.window:,})" for w in windows),
              flush=True)
        if not scaled:
            short = [w for w in args.windows if w >= args.window]
            print(f"plain rotary, each window after only the {args.window:,} tokens before it: " + ", ".join(
                f"{ppl(token_logprobs(llm.engine, ids[w - args.window:w + args.window + 1])[args.window:])} at "
                f"[{w:,}, {w + args.window:,})" for w in short), flush=True)
        del llm
        gc.collect()


def needle(args) -> None:
    text = code_text()
    for scaled in (False, True):
        for ctx in args.contexts:
            if ctx > args.trained and not scaled:
                print(f"plain rotary: {ctx:,} tokens is past the trained context; skipped")
                continue
            llm = _engine(args, scaled, ctx)
            ids = llm.tokenizer.encode(text)[:ctx - 96]
            for depth in args.depths:
                at = int(len(ids) * depth)
                haystack = llm.tokenizer.decode(ids[:at]) + NEEDLE + llm.tokenizer.decode(ids[at:])
                started = time.perf_counter()
                reply = llm.chat([{"role": "user", "content": haystack + "\n\n" + QUESTION}],
                                 SamplingParams(temperature=0, max_tokens=16))
                label = f"yarn x{args.scale:g}" if scaled else "plain rotary"
                print(f"{label}: {reply.prompt_tokens:,}-token prompt, needle at {depth:.0%}: "
                      f"{'found' if PASSWORD in reply.text else 'MISSED'} ({reply.text.strip()!r}) in "
                      f"{time.perf_counter() - started:.0f} s", flush=True)
            del llm
            gc.collect()


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("part", choices=["perplexity", "needle"])
    p.add_argument("--model", default="qwen2.5-coder-1.5b")
    p.add_argument("--scale", type=float, default=4.0, help="rope_scale of the yarn runs")
    p.add_argument("--trained", type=int, default=32768, help="the model's trained context")
    p.add_argument("--tokens", type=int, default=40000, help="perplexity: tokens of code teacher-forced")
    p.add_argument("--windows", type=int, nargs="+", default=[0, 30000, 38000])
    p.add_argument("--window", type=int, default=2000)
    p.add_argument("--contexts", type=int, nargs="+", default=[40000])
    p.add_argument("--depths", type=float, nargs="+", default=[0.25, 0.5, 0.75])
    args = p.parse_args(argv)
    {"perplexity": perplexity, "needle": needle}[args.part](args)


if __name__ == "__main__":
    main(sys.argv[1:])
