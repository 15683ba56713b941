"""What the soak's clients do (bench/soak.py): a seeded plan of jobs (Poisson arrivals, random prompt
and reply lengths, chat or completions, streamed or not, and a behaviour), and one coroutine that
carries a job out over HTTP and says how it went.

Routes: OpenAI chat and text completions, and a share of normal jobs on the other doors: a
two-turn Responses conversation (the second turn by previous_response_id, so the server's kept
responses churn), Anthropic messages and Ollama chat, each checked for its own way of ending.

Behaviours: most jobs are `normal`; 10 % hang up at a random point (`disconnect`), 5 % are cancelled
with DELETE /v1/requests/{id} (`cancel`), 5 % read their stream slowly (`slow`) and 5 % are bad
requests that must get a 4xx (`bad`). Only normal streamed jobs on the OpenAI routes are timed
(TTFT, ITL): they ask for logprobs, so every token shows up in its chunk even when its text is empty.

A cancelled request may end as finish_reason "cancelled" or as the server's answer to an operator's
cancel (503, or an error event, with code "cancelled"); that answer is expected, so it is kept out of
the 5xx count and counted in `Outcome.cancelled_by_server` instead.
"""
from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import httpx

from loadgen import StreamTrace

BEHAVIOURS = (("normal", 0.75), ("disconnect", 0.10), ("cancel", 0.05), ("slow", 0.05), ("bad", 0.05))
ROUTES = (("chat", 0.35), ("completions", 0.35), ("responses", 0.1), ("messages", 0.1), ("ollama", 0.1))
DOORS = ("responses", "messages", "ollama")   # normal jobs only; the model is named MODEL
MODEL = "soak"
WORDS = ("the quick brown fox jumps over lazy dog paged cache keeps keys values every request fixed size "
         "blocks many users share one model def generate prompt tokens step logits append return for sum "
         "Der schnelle braune Fuchs Größere Modelle 敏捷的 棕色 狐狸 Numbers 0 1 2 42 3.14 🙂 🚀 →").split()
# (method, path, body): each must be answered 4xx; a body of bytes is sent as it is
BAD_REQUESTS = (
    ("POST", "/v1/chat/completions", b'{"messages": ['),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "temperature": -1}),
    ("POST", "/v1/completions", {"prompt": "hi", "model": "no-such-model"}),
    ("POST", "/v1/completions", {"prompt": "hi", "logprobs": 21}),
    ("POST", "/v1/completions", {"prompt": "fox " * 3000}),
    ("POST", "/v1/completions", {"prompt": [1, 2, 10**6]}),
    ("POST", "/v1/completions", b'{"prompt": "' + b"x" * (2 * 2**20) + b'"}'),
    ("DELETE", "/v1/requests/cmpl-no-such-request", None),
)
FINISHED = ("length", "stop")


@dataclass(frozen=True)
class Job:
    n: int
    at_s: float              # seconds after the run's start
    route: str               # ROUTES
    stream: bool
    prompt: str
    max_tokens: int
    behaviour: str
    cut: float               # disconnect: the fraction of the reply read before hanging up


@dataclass
class Outcome:
    job: Job
    statuses: list[int] = field(default_factory=list)     # every HTTP status this job saw
    cancelled_by_server: bool = False                     # answered as the operator's cancel
    problem: str | None = None                            # what went wrong that should not have
    trace: StreamTrace | None = None                      # normal streamed jobs: chunk arrivals


def draw_jobs(seed: int, rate_per_s: float, duration_s: float, max_jobs: int) -> list[Job]:
    rng, at, jobs = random.Random(seed), 0.0, []
    while at < duration_s and len(jobs) < max_jobs:
        behaviour = rng.choices([b for b, _ in BEHAVIOURS], [w for _, w in BEHAVIOURS])[0]
        stream = behaviour == "slow" or rng.random() < 0.6
        prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 300)))
        max_tokens = int(2 ** rng.uniform(0, 8))                     # 1 to 256, log-uniform
        route = rng.choices([r for r, _ in ROUTES], [w for _, w in ROUTES])[0]
        if route in DOORS and behaviour != "normal":
            route = rng.choice(("chat", "completions"))
        jobs.append(Job(len(jobs), at, route, stream, prompt, max_tokens, behaviour, rng.random()))
        at += rng.expovariate(rate_per_s)
    return jobs


def request_body(job: Job, timed: bool) -> tuple[str, dict]:
    body: dict = {"max_tokens": job.max_tokens, "temperature": 0.8, "seed": job.n, "ignore_eos": True,
                  "stream": job.stream, "user": f"soak-{job.n}"}
    if job.route == "chat":
        body["messages"] = [{"role": "user", "content": job.prompt}]
        body |= {"logprobs": True} if timed else {}
        return "/v1/chat/completions", body
    body["prompt"] = job.prompt
    body |= {"logprobs": 0} if timed else {}
    return "/v1/completions", body


async def run_job(client: httpx.AsyncClient, job: Job, start: float) -> Outcome:
    await asyncio.sleep(max(0.0, start + job.at_s - time.perf_counter()))
    out = Outcome(job)
    try:
        if job.behaviour == "bad":
            await _bad(client, job, out)
        elif job.route in DOORS:
            await _door(client, job, out)
        elif job.stream:
            await _streamed(client, job, out)
        else:
            await _whole(client, job, out)
    except Exception as e:  # noqa: BLE001 - one job's surprise is its problem, never the end of the run
        out.problem = f"{type(e).__name__}: {e}"
    return out


async def _bad(client: httpx.AsyncClient, job: Job, out: Outcome) -> None:
    method, path, body = BAD_REQUESTS[job.n % len(BAD_REQUESTS)]
    kwargs = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) \
        else {"json": body} if body is not None else {}
    r = await client.request(method, path, **kwargs)
    out.statuses.append(r.status_code)
    if not 400 <= r.status_code < 500:
        out.problem = f"bad request {method} {path} answered {r.status_code}: {r.text[:200]}"


async def _whole(client: httpx.AsyncClient, job: Job, out: Outcome) -> None:
    path, body = request_body(job, timed=False)
    post = asyncio.ensure_future(client.post(path, json=body))
    if job.behaviour == "disconnect":   # hang up before the answer: the server must cancel the request
        await asyncio.wait({post}, timeout=job.cut * 0.5)
        if not post.done():
            post.cancel()
            await asyncio.gather(post, return_exceptions=True)
            return
    elif job.behaviour == "cancel":
        await _cancel_by_user(client, f"soak-{job.n}", out, post)
    r = await post
    if job.behaviour == "cancel" and _is_cancel_answer(r):
        out.cancelled_by_server = True
        return
    out.statuses.append(r.status_code)
    if r.status_code != 200:
        out.problem = f"answered {r.status_code}: {r.text[:200]}"
        return
    reason = r.json()["choices"][0]["finish_reason"]
    if reason not in FINISHED + (("cancelled",) if job.behaviour == "cancel" else ()):
        out.problem = f"finish_reason {reason!r}"


async def _cancel_by_user(client: httpx.AsyncClient, user: str, out: Outcome, post: asyncio.Future) -> None:
    """Finds the request by its `user` in the request table and cancels it (unless it ends first)."""
    while not post.done():
        table = await client.get("/v1/requests")
        out.statuses.append(table.status_code)
        row = next((row for row in table.json().get("data", []) if row["client"] == user), None)
        if row is not None:
            r = await client.delete(f"/v1/requests/{row['id']}")
            out.statuses.append(r.status_code)
            return
        await asyncio.sleep(0.01)


async def _streamed(client: httpx.AsyncClient, job: Job, out: Outcome) -> None:
    timed = job.behaviour == "normal"
    path, body = request_body(job, timed)
    out.trace = StreamTrace(submitted=time.perf_counter()) if timed else None
    async with client.stream("POST", path, json=body) as r:
        out.statuses.append(r.status_code)
        if r.status_code != 200:
            out.problem = f"answered {r.status_code}: {(await r.aread()).decode(errors='replace')[:200]}"
            return
        await _read_events(client, job, out, r)


async def stream_lines(r: httpx.Response) -> AsyncIterator[bytes]:
    """A stream's lines, split only where SSE and NDJSON end them (LF, CR LF). httpx's aiter_lines
    also splits at U+0085, U+2028 and U+2029, which JSON text may hold unescaped (a random model's
    reply does, now and then)."""
    buffer = b""
    async for chunk in r.aiter_bytes():
        *lines, buffer = (buffer + chunk).split(b"\n")
        for line in lines:
            yield line.rstrip(b"\r")


async def sse_data(r: httpx.Response) -> AsyncIterator[str]:
    """The `data:` payloads of an event stream."""
    async for line in stream_lines(r):
        if line.startswith(b"data: "):
            yield line[6:].decode()


async def _read_events(client: httpx.AsyncClient, job: Job, out: Outcome, r: httpx.Response) -> None:
    chunks, reason = 0, None
    async for data in sse_data(r):
        if not data.startswith("{"):
            continue
        payload = json.loads(data)
        if "error" in payload:
            if job.behaviour == "cancel" and payload["error"].get("code") == "cancelled":
                out.cancelled_by_server = True
            else:
                out.problem = f"error event: {payload['error']}"
            return
        chunks += 1
        reason = _note_chunk(out, payload) or reason
        if job.behaviour == "disconnect" and chunks >= job.cut * job.max_tokens:
            return                          # leaving the `async with` hangs up mid-stream
        if job.behaviour == "slow":
            await asyncio.sleep(0.02 + 0.08 * job.cut)
        if job.behaviour == "cancel" and chunks == 1:
            cancelled = await client.delete(f"/v1/requests/{payload['id']}")
            out.statuses.append(cancelled.status_code)
    allowed = FINISHED + (("cancelled",) if job.behaviour == "cancel" else ())
    if reason not in allowed and job.behaviour != "disconnect":
        out.problem = f"stream ended with finish_reason {reason!r}"


def _is_cancel_answer(r: httpx.Response) -> bool:
    try:
        return r.status_code == 503 and r.json()["error"]["code"] == "cancelled"
    except (ValueError, KeyError, TypeError):
        return False


def _note_chunk(out: Outcome, payload: dict) -> str | None:
    """Records a timed chunk's tokens; returns its finish_reason."""
    choice = payload["choices"][0]
    if out.trace is not None:
        logprobs = choice.get("logprobs") or {}
        tokens = len(logprobs.get("content") or logprobs.get("tokens") or [])
        if tokens:
            out.trace.arrivals.append((time.perf_counter(), tokens))
    return choice.get("finish_reason")


# ---- the other doors: each answer must end the way its API ends one -------------------------------
async def _door(client: httpx.AsyncClient, job: Job, out: Outcome) -> None:
    ask = [{"role": "user", "content": job.prompt}]
    if job.route == "responses":
        first = await _answer(client, job, out, "/v1/responses", {"input": ask}, stream=False)
        if first is None:
            return
        # the conversation may outgrow the context: then the refusal is the right answer
        second = await _answer(client, job, out, "/v1/responses",
                               {"input": "more", "previous_response_id": first["id"]}, job.stream,
                               overflow_ok=True)
        if second is not None and (second["previous_response_id"] != first["id"]
                                   or second["usage"]["input_tokens"] <= first["usage"]["input_tokens"]):
            out.problem = f"the second turn did not continue the first: {second['usage']}"
    elif job.route == "messages":
        await _answer(client, job, out, "/v1/messages", {"model": MODEL, "messages": ask}, job.stream)
    else:
        await _answer(client, job, out, "/api/chat", {"model": MODEL, "messages": ask}, job.stream)


async def _answer(client: httpx.AsyncClient, job: Job, out: Outcome, path: str, body: dict,
                  stream: bool, overflow_ok: bool = False) -> dict | None:
    """The final object of one request on another door (the response, the message, Ollama's last
    line), or None after noting what went wrong."""
    limit = {"/v1/responses": {"max_output_tokens": job.max_tokens}, "/v1/messages": {"max_tokens": job.max_tokens},
             "/api/chat": {"options": {"num_predict": job.max_tokens, "temperature": 0.8, "seed": job.n}}}[path]
    body = body | limit | {"stream": stream} | ({} if path == "/api/chat" else {"temperature": 0.8})
    final = None
    async with client.stream("POST", path, json=body) as r:
        out.statuses.append(r.status_code)
        if r.status_code != 200:
            text = (await r.aread()).decode(errors="replace")
            if not (overflow_ok and r.status_code == 400 and '"context_length_exceeded"' in text):
                out.problem = f"{path} answered {r.status_code}: {text[:200]}"
            return None
        if not stream:
            final = json.loads(await r.aread())
        elif path == "/api/chat":
            async for line in stream_lines(r):
                final = json.loads(line) if line.strip() else final
        else:
            async for data in sse_data(r):
                event = json.loads(data)
                if event.get("type") in ("response.completed", "response.incomplete"):
                    final = event["response"]
                elif event.get("type") == "message_delta":
                    final = {"stop_reason": event["delta"]["stop_reason"]}
                elif event.get("type") in ("error", "response.failed"):
                    out.problem = f"{path} stream failed: {data[:200]}"
                    return None
    ended = (final or {}).get("status") if path == "/v1/responses" else (final or {}).get(
        "stop_reason" if path == "/v1/messages" else "done_reason")
    if ended not in ("completed", "incomplete", "end_turn", "max_tokens", "stop", "length"):
        out.problem = f"{path}{' stream' if stream else ''} ended as {ended!r}"
        return None
    return final
