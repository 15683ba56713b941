"""The HTTP load generator: a `Workload` (bench/loadgen.py) sent to an OpenAI-compatible server as
streamed `POST /v1/completions` requests, with the arrival time and token count of every SSE chunk.

One AsyncClient, HTTP/1.1, one connection per stream; each chunk is parsed once. A chunk's tokens
are counted from its `logprobs` when the workload asks for them (exact), else as one per chunk with
text; the final usage chunk's `completion_tokens` is the total either way, and tokens the server
never showed (empty text) are counted as arriving with the finishing chunk.

    python bench/http_loadgen.py --url http://127.0.0.1:8000 --concurrency 8 --prompt-len 128 \
        --new-tokens 64 [--api-key K] [--rate 2 [--poisson-seed 0]] [--logprobs]
"""
from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path

import click
import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))          # loadgen, models
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))   # engine, without `pip -e`

from loadgen import LoadResult, Schedule, StreamTrace, Workload, random_prompts  # noqa: E402

_DATA = "data: "


def _request_body(prompt: tuple[int, ...], workload: Workload) -> dict:
    body = {"prompt": list(prompt), "max_tokens": workload.new_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    if workload.logprobs:
        body["logprobs"] = 0
    return body


def _read_chunk(trace: StreamTrace, payload: dict, now: float) -> int | None:
    """Records one parsed chunk; returns the usage chunk's completion_tokens, else None."""
    if "error" in payload:
        trace.error = payload["error"].get("message", str(payload["error"]))
        return None
    if payload.get("usage") and not payload.get("choices"):
        return payload["usage"]["completion_tokens"]
    choice = payload["choices"][0]
    logprobs = choice.get("logprobs")
    n = len(logprobs["tokens"]) if logprobs else int(bool(choice.get("text")))
    if n:
        trace.arrivals.append((now, n))
    if choice.get("finish_reason") is not None:
        trace.finish_reason = choice["finish_reason"]
        if not n:
            trace.arrivals.append((now, 0))     # where unseen tokens are placed (see _settle)
    return None


def _settle(trace: StreamTrace, total: int | None) -> None:
    """Gives tokens the chunks did not show to the finishing chunk; drops its empty placeholder."""
    missing = (total or 0) - trace.tokens
    if trace.arrivals and trace.arrivals[-1][1] == 0:
        at, _ = trace.arrivals.pop()
        if missing > 0:
            trace.arrivals.append((at, missing))
    elif missing > 0 and trace.arrivals:
        at, n = trace.arrivals.pop()
        trace.arrivals.append((at, n + missing))


async def _stream(client: httpx.AsyncClient, prompt: tuple[int, ...], workload: Workload,
                  at: float) -> StreamTrace:
    await asyncio.sleep(max(0.0, at - time.perf_counter()))
    trace = StreamTrace(submitted=time.perf_counter())
    total = None
    try:
        async with client.stream("POST", "/v1/completions", json=_request_body(prompt, workload)) as r:
            if r.status_code != 200:
                trace.error = f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:300]}"
                return trace
            async for line in r.aiter_lines():
                if not line.startswith(_DATA):
                    continue                    # blank separators and `: keep-alive` comments
                data = line[len(_DATA):]
                if data == "[DONE]":
                    break
                usage = _read_chunk(trace, json.loads(data), time.perf_counter())
                total = usage if usage is not None else total
    except httpx.HTTPError as e:
        trace.error = f"{type(e).__name__}: {e}"
    _settle(trace, total)
    if trace.error is None and trace.finish_reason is None:
        trace.error = "the stream ended without a finish_reason"
    return trace


async def _run(url: str, workload: Workload, api_key: str, timeout_s: float) -> list[StreamTrace]:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=len(workload.prompts) + 1)
    # no proxies from the environment: the load goes straight to the server being measured
    async with httpx.AsyncClient(base_url=url, headers=headers, limits=limits, trust_env=False,
                                 timeout=httpx.Timeout(timeout_s, connect=30.0)) as client:
        starts = workload.starts(time.perf_counter())
        return await asyncio.wait_for(
            asyncio.gather(*(_stream(client, p, workload, at) for p, at in starts)), timeout_s)


def run_http_workload(url: str, workload: Workload, api_key: str = "",
                      timeout_s: float = 1800) -> tuple[LoadResult, list[StreamTrace]]:
    """Runs the workload against the server at `url`; failed streams are in the result's errors."""
    traces = asyncio.run(_run(url.rstrip("/"), workload, api_key, timeout_s))
    return LoadResult.of(traces), traces


@click.command()
@click.option("--url", default="http://127.0.0.1:8000", show_default=True,
              help="base URL of an OpenAI-compatible server (e.g. `pagedserve serve`)")
@click.option("--concurrency", default=8, show_default=True, type=click.IntRange(1),
              help="streams; all submitted at once unless --rate is given")
@click.option("--prompt-len", default=128, show_default=True, type=click.IntRange(1),
              help="prompt length in token ids (random ids 3..499, known to any real tokenizer)")
@click.option("--new-tokens", default=64, show_default=True, type=click.IntRange(1),
              help="tokens generated per stream (ignore_eos: always exactly this many)")
@click.option("--api-key", default="", envvar="PAGEDSERVE_API_KEY", help="sent as a Bearer token")
@click.option("--rate", default=0.0, type=click.FloatRange(0), show_default=True,
              help="streams per second (fixed spacing); 0 = all at once")
@click.option("--poisson-seed", default=None, type=int,
              help="with --rate: Poisson arrivals drawn with this seed instead of fixed spacing")
@click.option("--logprobs/--no-logprobs", default=False, show_default=True,
              help="count tokens from logprobs: exact per chunk, also for tokens without text")
@click.option("--seed", default=0, show_default=True, help="seed of the random prompts")
@click.option("--timeout-s", default=600.0, show_default=True, help="limit for the whole run")
def main(url, concurrency, prompt_len, new_tokens, api_key, rate, poisson_seed, logprobs, seed,
         timeout_s):
    """Load a running server: aggregate output tok/s, TTFT and ITL p50/p99."""
    if poisson_seed is not None and not rate:
        raise click.BadParameter("needs --rate above 0 (arrivals per second)", param_hint="--poisson-seed")
    if not rate:
        schedule = Schedule.burst(concurrency)
    elif poisson_seed is None:
        schedule = Schedule.fixed_rate(concurrency, rate)
    else:
        schedule = Schedule.poisson(concurrency, rate, poisson_seed)
    prompts = random_prompts(concurrency, prompt_len, seed)
    workload = Workload(tuple(map(tuple, prompts)), new_tokens, schedule, logprobs)
    result, traces = run_http_workload(url, workload, api_key, timeout_s)
    click.echo(result.summary())
    for error in sorted(set(result.errors)):
        click.echo(f"error ({result.errors.count(error)}x): {error}", err=True)
    short = sum(1 for t in traces if not t.error and t.tokens != new_tokens)
    if short:
        click.echo(f"{short} streams ended with another token count than {new_tokens}", err=True)
    sys.exit(1 if result.errors or short else 0)


if __name__ == "__main__":
    main()
