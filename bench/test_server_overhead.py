"""What the HTTP server costs: the same workloads through `pagedserve serve` on loopback (streamed
/v1/completions, read by bench/http_loadgen.py) and in process (EngineLoop stepped by this thread
through bench/loadgen.py), with the same engine settings, prompts, output length and arrival
schedule.

One engine at a time: every HTTP load runs first, the server is stopped, then the in-process engine
is built for the in-process loads (class-scoped fixtures end with their class). The HTTP client runs
in this process and competes with the server for the same cores: that is part of the overhead
measured here. Speed is reported, never asserted; every stream must bring exactly the tokens asked.
Besides tok/s and latencies, each concurrency gets a "steady decode" group: the decode rate once
every stream has its first token, which leaves out how a burst's prefills happened to be batched.
"""
from __future__ import annotations

import gc
import sys
import time
from pathlib import Path

import pytest

from engine import LLM
from http_loadgen import run_http_workload
from loadgen import LoadResult, StreamTrace, Workload, random_prompts, run_workload

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))   # the shared helper
from server_process import ServerProcess  # noqa: E402

CONCURRENCY = (1, 8, 16)
PROMPT_LEN = 128
KV_POOL_TOKENS = 8192
READY_TIMEOUT_S = 600
WARM_UP_SEED = 99               # a prompt no measured run shares: no prefix-cache hit


def engine_settings(checkpoint: Path, dtype: str, new_tokens: int) -> dict:
    """The one set of engine settings both sides use (explicit, so no config file can differ)."""
    return dict(model=str(checkpoint), dtype=dtype, device="cpu", threads=0, compile=False,
                prefix_cache=True, max_concurrency=max(CONCURRENCY), kv_pool_tokens=KV_POOL_TOKENS,
                max_model_len=PROMPT_LEN + new_tokens)


# the settings ServerProcess passes as its own arguments; serve_flags spells the rest
SERVER_PROCESS_ARGS = ("model", "dtype", "max_model_len", "kv_pool_tokens")


def serve_flags(settings: dict) -> list[str]:
    flags = []
    for key, value in settings.items():
        if key in SERVER_PROCESS_ARGS:
            continue
        name = key.replace("_", "-")
        flags += [f"--{name}" if value else f"--no-{name}"] if isinstance(value, bool) else \
            [f"--{name}", str(value)]
    return flags


def workload(concurrency: int, new_tokens: int, *, seed: int | None = None,
             logprobs: bool = True) -> Workload:
    """logprobs: the bench tokenizer spells almost none of the generated ids, so without them the
    server sends no chunk before the last one and TTFT/ITL cannot be seen over HTTP."""
    prompts = random_prompts(concurrency, PROMPT_LEN, seed=concurrency if seed is None else seed)
    return Workload.burst(prompts, new_tokens, logprobs=logprobs)


WARM_UP = workload(1, 2, seed=WARM_UP_SEED)


@pytest.fixture(scope="module")
def http_results() -> dict[int, LoadResult]:
    """concurrency -> the HTTP run's result, so the in-process rows can note the difference."""
    return {}


@pytest.fixture(scope="class")
def server_url(bench_checkpoint, bench_dtype, bench_new_tokens, tmp_path_factory):
    settings = engine_settings(bench_checkpoint, bench_dtype, bench_new_tokens)
    # its own working directory: no config.toml of the caller's can change the settings
    server = ServerProcess(settings["model"], *serve_flags(settings), dtype=settings["dtype"],
                           max_model_len=settings["max_model_len"],
                           kv_pool_tokens=settings["kv_pool_tokens"],
                           workdir=tmp_path_factory.mktemp("serve"))
    try:
        server.wait_ready(READY_TIMEOUT_S)
        warm, _ = run_http_workload(server.url, WARM_UP)   # the streamed path's first call too
        assert not warm.errors, warm.errors
        yield server.url
    finally:
        server.stop()


@pytest.fixture(scope="class")
def engine_loop(bench_checkpoint, bench_dtype, bench_new_tokens):
    llm = LLM(**engine_settings(bench_checkpoint, bench_dtype, bench_new_tokens))
    loop = llm.engine.loop
    run_workload(loop, WARM_UP)                 # first-call costs stay out
    yield loop
    llm.close()
    del llm
    gc.collect()


def check_streams(result: LoadResult, concurrency: int, new_tokens: int) -> None:
    assert not result.errors, result.errors
    assert result.streams == concurrency
    assert result.output_tokens == concurrency * new_tokens


LATENCIES = {"ttft_p50_s": "TTFT p50", "ttft_p99_s": "TTFT p99", "itl_p50_s": "ITL p50",
             "itl_p99_s": "ITL p99"}


def report(bench_report, side: str, result: LoadResult, concurrency: int,
           http: LoadResult | None = None) -> None:
    """Rows of one side; HTTP is each group's subject, so the ratio column reads HTTP / in-process.
    The in-process rows, given the HTTP result, note what the server added."""
    subject = side == "HTTP"
    note = f"{concurrency} x {PROMPT_LEN}-token prompts at once, {result.output_tokens // concurrency} new"
    if http is not None:
        note = f"server overhead {1 - http.tok_s / result.tok_s:+.1%} of tok/s (goal under 10 %)"
    bench_report.add(f"server c={concurrency} tok/s", side, result.tok_s, "tok/s", subject=subject,
                     note=note)
    for metric, label in LATENCIES.items():
        value = getattr(result, metric)
        if value is None:
            continue                            # ITL of a 1-token stream: nothing to report
        theirs = None if http is None else getattr(http, metric)
        note = "" if theirs is None else f"HTTP adds {(theirs - value) * 1e3:+.1f} ms"
        bench_report.add(f"server c={concurrency} {label}", side, value * 1e3, "ms",
                         subject=subject, note=note)
    report_steady_decode(bench_report, side, result, concurrency, http)


def report_steady_decode(bench_report, side: str, result: LoadResult, concurrency: int,
                         http: LoadResult | None) -> None:
    """Decode rate once every stream runs (LoadResult.steady_tok_s): serving overhead without the
    race of how a burst's prefills were batched, which swamps it in tok/s and TTFT."""
    if result.steady_tok_s is None:
        return                                  # nothing came after the last first token
    note = "tokens after the last stream's first token / time to the last token"
    if http is not None and http.steady_tok_s is not None:
        note = f"server overhead {1 - http.steady_tok_s / result.steady_tok_s:+.1%} of steady tok/s"
    bench_report.add(f"server c={concurrency} steady decode", side, result.steady_tok_s, "tok/s",
                     subject=side == "HTTP", note=note)


class TestOverHTTP:
    @pytest.mark.parametrize("concurrency", CONCURRENCY)
    def test_http_load(self, benchmark, server_url, http_results, bench_report, bench_new_tokens,
                       concurrency):
        benchmark.group = f"server c={concurrency}"
        result, _ = benchmark.pedantic(run_http_workload,
                                       args=(server_url, workload(concurrency, bench_new_tokens)),
                                       rounds=1, iterations=1)
        check_streams(result, concurrency, bench_new_tokens)
        http_results[concurrency] = result
        benchmark.extra_info.update(tok_s=result.tok_s, ttft_p50_ms=(result.ttft_p50_s or 0) * 1e3,
                                    steady_tok_s=result.steady_tok_s)
        report(bench_report, "HTTP", result, concurrency)

    def test_counts_tokens_without_logprobs(self, server_url, bench_new_tokens):
        """The logprobs-free counting (the CLI's default): chunks without text show no tokens, so
        the usage chunk's total must be credited to the finishing chunk. Runs after this class's
        measured loads, so it cannot disturb them."""
        new_tokens = min(bench_new_tokens, 8)
        result, _ = run_http_workload(server_url, workload(2, new_tokens, logprobs=False))
        check_streams(result, 2, new_tokens)


class TestInProcess:
    @pytest.mark.parametrize("concurrency", CONCURRENCY)
    def test_in_process_load(self, benchmark, engine_loop, http_results, bench_report,
                             bench_new_tokens, concurrency):
        benchmark.group = f"server c={concurrency}"
        result = benchmark.pedantic(run_workload,
                                    args=(engine_loop, workload(concurrency, bench_new_tokens)),
                                    rounds=1, iterations=1)
        check_streams(result, concurrency, bench_new_tokens)
        benchmark.extra_info.update(tok_s=result.tok_s, ttft_p50_ms=(result.ttft_p50_s or 0) * 1e3,
                                    steady_tok_s=result.steady_tok_s)
        report(bench_report, "in-process", result, concurrency, http_results.get(concurrency))


@pytest.fixture(scope="class")
def batch_llm(bench_checkpoint, bench_dtype, bench_new_tokens):
    """LLM.generate runs the loop in the calling thread: no loop thread, no stream readers."""
    llm = LLM(**engine_settings(bench_checkpoint, bench_dtype, bench_new_tokens))
    llm.generate([list(p) for p in WARM_UP.prompts], WARM_UP.params())
    yield llm
    llm.close()
    del llm
    gc.collect()


class TestLLMGenerate:
    @pytest.mark.parametrize("concurrency", CONCURRENCY)
    def test_llm_generate(self, benchmark, batch_llm, http_results, bench_report, bench_new_tokens,
                          concurrency):
        """The issue's baseline: the same prompts and params through the offline API, all at once."""
        load = workload(concurrency, bench_new_tokens)
        benchmark.group = f"server c={concurrency}"
        t0 = time.perf_counter()
        outs = benchmark.pedantic(batch_llm.generate, args=([list(p) for p in load.prompts], load.params()),
                                  rounds=1, iterations=1)
        tok_s = sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t0)
        assert [len(o.token_ids) for o in outs] == [bench_new_tokens] * concurrency
        http = http_results.get(concurrency)
        note = "same prompts and params, one LLM.generate call"
        if http is not None:
            note = f"server overhead {1 - http.tok_s / tok_s:+.1%} of tok/s against LLM.generate"
        bench_report.add(f"server c={concurrency} tok/s", "LLM.generate", tok_s, "tok/s", note=note)


def test_steady_decode_counts_only_tokens_after_every_stream_started():
    """The arithmetic behind the steady decode rows, on hand-made arrival times."""
    early = StreamTrace(submitted=0.0, arrivals=[(1.0, 1), (2.0, 1), (3.0, 1)])
    late = StreamTrace(submitted=0.0, arrivals=[(2.0, 1), (2.5, 2), (4.0, 1)])
    # the last first token came at 2.0; after it: 1 (early) + 2 + 1 (late) tokens until 4.0
    assert LoadResult.of([early, late]).steady_tok_s == pytest.approx(4 / 2.0)
    single_chunk = StreamTrace(submitted=0.0, arrivals=[(1.0, 5)])
    assert LoadResult.of([single_chunk]).steady_tok_s is None
