"""N-gram speculation against plain decoding on the same model, in one process: wall time of greedy
replies to a code-editing prompt (the reply repeats most of the prompt's code) and to a prompt
whose reply does not repeat it, at 1 and 8 streams, rounds alternated, medians and the per-round
ratio. Greedy outputs are compared: in bf16 a verify row's logits come from a multi-token GEMM whose
rounding differs from a one-token step, so a near-tie can flip; the first differing position is shown.

    .venv/bin/python bench/speculative_decode.py                       # default model
    .venv/bin/python bench/speculative_decode.py --model qwen2.5-coder-0.5b --rounds 5
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine import LLM, SamplingParams  # noqa: E402

CODE = '''def parse_config(path):
    values = {}
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            key, value = line.split("=", 1)
            values[key.strip()] = value.strip()
    return values


def merge(base, override):
    out = dict(base)
    for key, value in override.items():
        out[key] = value
    return out
'''
PROMPTS = {
    "edit": [{"role": "user", "content": "Add type hints to every function below and return the whole file, "
                                         "unchanged otherwise.\n\n```python\n" + CODE + "```"}],
    "fresh": [{"role": "user", "content": "Write a Python function that returns the n-th prime number, "
                                          "with a docstring and a short explanation."}],
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
    args = p.parse_args(argv)
    common = dict(model=args.model, max_concurrency=max(args.streams), max_model_len=1024, kv_pool_tokens=8192)
    engines = {"none": LLM(**common), "ngram": LLM(**common, speculative="ngram")}
    print(f"{args.model}: {engines['none'].engine.weights}, dtype {engines['none'].engine.dtype}")
    for name in args.prompts:
        conv = PROMPTS[name]
        for streams in args.streams:
            convs = [conv] * streams
            run(engines["none"], convs, 8), run(engines["ngram"], convs, 8)        # warm-up
            times = {"none": [], "ngram": []}
            for _ in range(args.rounds):
                outs = {}
                for mode, llm in engines.items():
                    before = llm.engine.scheduler.stats()
                    seconds, outs[mode] = run(llm, convs, args.tokens)
                    times[mode].append(seconds)
                after = engines["ngram"].engine.scheduler.stats()
                for a, b in zip(outs["none"], outs["ngram"]):
                    if a != b:
                        first = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
                        print(f"  {name} x{streams}: a reply differs from token {first} on")
                        break
            proposed = after.spec_proposed_tokens_total - before.spec_proposed_tokens_total
            accepted = after.spec_accepted_tokens_total - before.spec_accepted_tokens_total
            ratios = [b / a for a, b in zip(times["ngram"], times["none"])]
            tok = streams * args.tokens
            print(f"  {name:5s} x{streams}: none {tok / statistics.median(times['none']):6.1f} tok/s, "
                  f"ngram {tok / statistics.median(times['ngram']):6.1f} tok/s, speed-up median "
                  f"{statistics.median(ratios):.2f} (rounds {', '.join(f'{r:.2f}' for r in ratios)}); "
                  f"last round accepted {accepted}/{proposed} proposals")


if __name__ == "__main__":
    main(sys.argv[1:])
