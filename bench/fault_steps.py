"""Steps that raise, for the fault suite (bench/faults.py): a server started with the debug hook
PAGEDSERVE_DEBUG_FAIL_STEPS (engine/debug_hooks.py) fails two chosen steps. Over HTTP, the requests
live in such a step must fail with a clear error (a 500 engine_error, or an error event ending the
stream), nothing may stay in use after it, and the requests sent after it must be served."""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from engine.debug_hooks import FAIL_STEPS_ENV
from server_process import ServerProcess

# Steps are numbered from 0 over the steps that ran rows; the warm-up request takes the first few.
# Each phase's requests (600 tokens) are all admitted long before the next failing step and live
# past it, so each failure hits every request of its phase.
FAIL_STEPS = (100, 400)
LONG, SHORT = 600, 32
Result = tuple[list[str], list[str]]


def step_failures(model: Path, workdir: Path) -> Result:
    lines, problems = [], []
    with ServerProcess(model, "--max-concurrency", "4", max_model_len=1024, kv_pool_tokens=8192, workdir=workdir,
                       env={FAIL_STEPS_ENV: ",".join(map(str, FAIL_STEPS))}) as server:
        for phase, (max_tokens, fails) in enumerate(((LONG, True), (LONG, True), (SHORT, False)), start=1):
            before = _stats(server)["steps_total"]
            answers = _phase(server, max_tokens)
            stats = _stats(server)
            left = {k: stats[k] for k in ("blocks_used", "slots_used", "running", "waiting")}
            lines.append(f"phase {phase} (steps {before}..{stats['steps_total'] - 1}): " + "; ".join(answers) +
                         f"; then {left}")
            expected = "failed on purpose" if fails else "200 length"
            if any(expected not in a for a in answers) or any(left.values()):
                problems.append(lines[-1])
        health = httpx.get(server.url + "/health", timeout=30).status_code
        lines.append(f"/health after the failures: {health}")
        if health != 200:
            problems.append(lines[-1])
    return lines, problems


def _stats(server: ServerProcess) -> dict:
    return httpx.get(server.url + "/v1/requests", timeout=30).json()["stats"]


def _phase(server: ServerProcess, max_tokens: int) -> list[str]:
    """Two streams (completions, chat) and one whole answer at once; how each ended."""
    base = {"max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}
    jobs = [("/v1/completions", base | {"prompt": "The quick brown fox", "stream": True}),
            ("/v1/chat/completions", base | {"messages": [{"role": "user", "content": "hi"}], "stream": True}),
            ("/v1/completions", base | {"prompt": "A paged cache"})]
    with ThreadPoolExecutor(len(jobs)) as pool:
        return list(pool.map(lambda job: _ask(server, *job), jobs))


def _ask(server: ServerProcess, path: str, body: dict) -> str:
    if not body.get("stream"):
        r = httpx.post(server.url + path, json=body, timeout=120)
        if r.status_code == 200:
            return f"200 {r.json()['choices'][0]['finish_reason']}"
        error = r.json()["error"]
        return f"{r.status_code} {error['code']}: {error['message']}"
    with httpx.stream("POST", server.url + path, json=body, timeout=120) as r:
        # split at LF only: iter_lines also splits at U+2028 and U+0085, which JSON strings may hold
        events = [json.loads(line[6:]) for line in r.read().split(b"\n") if line.startswith(b"data: {")]
    if events and "error" in events[-1]:
        error = events[-1]["error"]
        return f"stream error event {error['code']}: {error['message']}"
    finish = next((e["choices"][0]["finish_reason"] for e in reversed(events) if e.get("choices")), None)
    return f"200 {finish} (stream)"
