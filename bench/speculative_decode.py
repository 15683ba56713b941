"""Speculative decoding (n-gram lookup, a draft model) against plain decoding on the same model, in one
process: wall time of greedy replies to a code-editing prompt (a 166-line Python file, the stdlib's
colorsys.py, to return with type hints: the reply repeats most of the prompt), to a prompt whose
reply does not repeat it (a function from its docstring) and to one whose reply is prose, at 1 and 8
streams, rounds alternated, medians and the per-round ratio.
Greedy outputs are compared, and the first differing position shown: with the quantized CPU kernels a
verify row's tokens get the same bits as decode steps (README, "Speculative decoding"), so none should differ.

    .venv/bin/python bench/speculative_decode.py                       # default model, 0.5B draft
    .venv/bin/python bench/speculative_decode.py --methods none ngram --streams 1 --rounds 5
"""
from __future__ import annotations

import argparse
import colorsys
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine import LLM, SamplingParams  # noqa: E402

CODE = Path(colorsys.__file__).read_text()
PROMPTS = {
    "edit": [{"role": "user", "content": "Add type hints to every function below and return the whole file, "
                                         "unchanged otherwise.\n\n```python\n" + CODE + "```"}],
    "fresh": [{"role": "user", "content": "Write the body of this function, then explain it briefly.\n\n```python\n"
                                          "def nth_prime(n: int) -> int:\n    \"\"\"The n-th prime number "
                                          "(nth_prime(1) == 2), from a sieve that grows as needed.\"\"\"\n```"}],
    "prose": [{"role": "user", "content": "In a few paragraphs, when should a Python service use threads, "
                                          "processes or asyncio? No code."}],
}


def run(llm: LLM, convs, tokens: int):
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.chat(convs, params)
    return time.perf_counter() - start, [o.token_ids for o in outs]


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2.5-coder-1.5b")
    p.add_argument("--tokens", type=int, default=160)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--streams", type=int, nargs="+", default=[1, 8])
    p.add_argument("--prompts", nargs="+", choices=sorted(PROMPTS), default=list(PROMPTS))
    p.add_argument("--methods", nargs="+", choices=["none", "ngram", "draft"], default=["none", "ngram", "draft"])
    p.add_argument("--draft-model", default="qwen2.5-coder-0.5b")
    args = p.parse_args(argv)
    common = dict(model=args.model, max_concurrency=max(args.streams), max_model_len=4096, kv_pool_tokens=32768)
    extra = {"none": dict(speculative="none"), "ngram": dict(speculative="ngram"),
             "draft": dict(draft_model=args.draft_model)}
    engines = {m: LLM(**common, **extra[m]) for m in dict.fromkeys(["none", *args.methods])}
    print(f"{args.model}: {engines['none'].engine.weights}, dtype {engines['none'].engine.dtype}")
    for name in args.prompts:
        conv = PROMPTS[name]
        for streams in args.streams:
            convs = [conv] * streams
            for llm in engines.values():
                run(llm, convs, 8)                                      # warm-up
            times = {mode: [] for mode in engines}
            before = {mode: llm.engine.scheduler.stats() for mode, llm in engines.items()}
            for _ in range(args.rounds):
                outs = {}
                for mode, llm in engines.items():
                    seconds, outs[mode] = run(llm, convs, args.tokens)
                    times[mode].append(seconds)
                for mode in engines:
                    for a, b in zip(outs["none"], outs[mode]):
                        if a != b:
                            first = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
                            print(f"  {name} x{streams} {mode}: a reply differs from token {first} on")
                            break
            tok = streams * args.tokens
            line = f"  {name:5s} x{streams}: none {tok / statistics.median(times['none']):6.1f} tok/s"
            for mode in engines:
                if mode == "none":
                    continue
                after = engines[mode].engine.scheduler.stats()
                proposed = after.spec_proposed_tokens_total - before[mode].spec_proposed_tokens_total
                accepted = after.spec_accepted_tokens_total - before[mode].spec_accepted_tokens_total
                ratios = [b / a for a, b in zip(times[mode], times["none"])]
                line += (f"; {mode} {tok / statistics.median(times[mode]):6.1f} tok/s, speed-up median "
                         f"{statistics.median(ratios):.2f} (rounds {', '.join(f'{r:.2f}' for r in ratios)}), "
                         f"accepted {accepted}/{proposed}")
            print(line)


if __name__ == "__main__":
    main(sys.argv[1:])
