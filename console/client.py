"""The one object the console talks to: a small protocol, in-process and HTTP implementations,
and the ReplyBuffer that reads a reply on its own thread so the engine never waits for the UI.

Nothing here imports torch: the in-process client imports the engine when it connects.
"""
from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, fields
from typing import Any, Protocol

import httpx

from engine.stats import RequestRow

Progress = Callable[[int, int], None]   # (done_bytes, total_bytes) of a first-time preset download


class ConsoleClientError(RuntimeError):
    """The engine or server could not be reached or refused; the message says what to check."""


@dataclass
class ReplyDelta:
    text: str = ""
    finish_reason: str | None = None     # "stop", "length", "cancelled", "error" on the last delta
    error: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0           # total so far (0 when the transport does not say)
    cached_tokens: int = 0               # of prompt_tokens, those the prefix cache held


class ReplyStream(Protocol):
    id: str | None                       # the engine request id, once known

    def __iter__(self) -> Iterator[ReplyDelta]: ...
    def cancel(self) -> None: ...


@dataclass(frozen=True)
class EngineSnapshot:
    running: int = 0
    waiting: int = 0
    paused: int = 0
    blocks_used: int = 0
    blocks_total: int = 0
    slots_used: int = 0
    slots_total: int = 0
    generation_tokens_per_s: float = 0.0
    ttft_p50_s: float | None = None
    itl_p50_s: float | None = None
    itl_p99_s: float | None = None
    prefix_cache_hit_rate: float = 0.0      # hit / looked-up prompt tokens
    cached_blocks: int = 0
    spec_proposed_tokens_total: int = 0     # speculative decoding (0 while it is off)
    spec_acceptance_rate: float = 0.0
    spec_mean_acceptance_length: float = 0.0
    requests: tuple[RequestRow, ...] = ()

    @classmethod
    def from_fields(cls, stats: Any, requests: tuple[RequestRow, ...]) -> EngineSnapshot:
        """From anything with these attribute names (SchedulerStats) or keys (the /v1/requests JSON)."""
        get = stats.get if isinstance(stats, dict) else lambda name, default: getattr(stats, name, default)
        return cls(**{f.name: get(f.name, f.default) for f in fields(cls) if f.name != "requests"},
                      requests=requests)


class ConsoleClient(Protocol):
    def connect(self, progress: Progress) -> str: ...       # slow: call on a worker thread
    def stream(self, messages: list[dict], *, temperature: float, max_tokens: int,
               client: str) -> ReplyStream: ...
    def cancel(self, request_id: str) -> None: ...
    def snapshot(self) -> EngineSnapshot: ...
    def close(self) -> None: ...


class _EngineReply:
    def __init__(self, handle: Any):
        self._handle = handle
        self.id = handle.id

    def __iter__(self) -> Iterator[ReplyDelta]:
        for d in self._handle:
            reason = None if d.finish_reason is None else d.finish_reason.value
            yield ReplyDelta(d.text, reason, d.error, d.prompt_tokens, d.completion_tokens, d.cached_tokens)

    def cancel(self) -> None:
        self._handle.cancel()


def restored(tokens: int) -> str:
    """The description's note of a warm restart (prefix_cache_dir), or nothing."""
    return f" · {tokens:,} cached tokens restored" if tokens else ""


def context(max_model_len: int | None, rope_scaling: dict | None) -> str:
    """The description's context length, and the rotary scaling that stretches it (e.g. yarn x4)."""
    if not max_model_len:
        return ""
    scaled = f" ({rope_scaling['rope_type']} x{rope_scaling['factor']:g})" if rope_scaling else ""
    return f" · {max_model_len:,}-token context{scaled}"


class InProcessClient:
    """An engine in this process (`pagedserve chat --model M`)."""

    def __init__(self, engine_config: Any):
        self._config = engine_config
        self._engine: Any = None

    def connect(self, progress: Progress) -> str:
        from engine.client import EngineClient   # loads torch: only here, on the worker thread
        from engine.request import SamplingParams
        self._engine = EngineClient.from_config(self._config, progress=progress)
        # one token through the model now: its first step pays lazy imports and kernel set-up
        # (seconds), which belongs under the loading bar, not in the first reply's TTFT
        self._engine.submit(prompt="hi", params=SamplingParams(max_tokens=1), client="warm-up").result()
        info = self._engine.info()
        return (f"{info.model} · {info.architecture} · {info.dtype} on {info.device} · "
                f"weights {info.weights}{context(info.max_model_len, info.rope_scaling)} · "
                f"{info.kv_pool_tokens:,} K/V tokens "
                f"({info.kv_pool_bytes / 2**30:.1f} GiB, {info.kv_cache_dtype}){restored(info.restored_prefix_tokens)}")

    def stream(self, messages: list[dict], *, temperature: float, max_tokens: int,
               client: str) -> ReplyStream:
        from engine.request import SamplingParams
        params = SamplingParams(temperature=temperature, max_tokens=max_tokens)
        return _EngineReply(self._engine.submit(messages=messages, params=params, client=client))

    def cancel(self, request_id: str) -> None:
        self._engine.cancel(request_id)

    def snapshot(self) -> EngineSnapshot:
        stats = self._engine.stats()
        return EngineSnapshot.from_fields(stats, stats.requests)

    def close(self) -> None:
        if self._engine is not None:
            self._engine.close()


def _error_text(response: httpx.Response) -> str:
    try:
        body = response.json()
        detail = body["error"]["message"] if isinstance(body.get("error"), dict) else body
    except (ValueError, KeyError, TypeError, AttributeError):
        detail = response.text
    return f"HTTP {response.status_code}: {detail}"


class _HttpReply:
    """One streamed /v1/chat/completions call (OpenAI SSE); the chunk id is the engine request id."""

    def __init__(self, owner: HttpClient, body: dict):
        self._owner = owner
        self._body = body
        self._cancelled = threading.Event()
        self.id: str | None = None

    def __iter__(self) -> Iterator[ReplyDelta]:
        finish, usage, count = None, {}, 0
        try:
            with self._owner.http.stream("POST", "/v1/chat/completions", json=self._body) as resp:
                if resp.status_code != 200:
                    resp.read()
                    yield ReplyDelta(finish_reason="error", error=_error_text(resp))
                    return
                for line in resp.iter_lines():
                    if self._cancelled.is_set():
                        break
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    chunk = json.loads(data)
                    if "error" in chunk:
                        yield ReplyDelta(finish_reason="error", error=str(chunk["error"]))
                        return
                    self.id = self.id or chunk.get("id")
                    usage = chunk.get("usage") or usage
                    for choice in chunk.get("choices") or ():
                        finish = choice.get("finish_reason") or finish
                        text = (choice.get("delta") or {}).get("content") or ""
                        if text:
                            count += 1
                            yield ReplyDelta(text, completion_tokens=count)
        except (httpx.HTTPError, ValueError) as e:
            if not self._cancelled.is_set():
                yield ReplyDelta(finish_reason="error", error=f"{self._owner.url}: {e}")
                return
        if self._cancelled.is_set():
            self._owner.cancel_quietly(self.id)   # the id may have arrived after cancel() ran
            finish = "cancelled"
        yield ReplyDelta(finish_reason=finish or "stop", prompt_tokens=usage.get("prompt_tokens", 0),
                         completion_tokens=usage.get("completion_tokens", count),
                         cached_tokens=(usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0))

    def cancel(self) -> None:
        self._cancelled.set()
        self._owner.cancel_quietly(self.id)


class HttpClient:
    """A running `pagedserve serve` (`pagedserve chat --url URL [--api-key K]`)."""

    def __init__(self, url: str, api_key: str = "", transport: httpx.BaseTransport | None = None):
        self.url = url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(base_url=self.url, headers=headers, transport=transport,
                                 timeout=httpx.Timeout(10.0, read=None))

    def _get(self, path: str, *, ok_while_loading: bool = False) -> Any:
        try:
            resp = self.http.get(path)
        except httpx.HTTPError as e:
            raise ConsoleClientError(f"cannot reach {self.url}{path}: {e}; is `pagedserve serve` "
                                     f"running there? (check --url)") from None
        if ok_while_loading and resp.status_code == 503:
            return resp.json()
        if resp.status_code == 401:
            raise ConsoleClientError(f"{self.url} refused the API key ({_error_text(resp)}); "
                                     f"pass the server's key with --api-key")
        if resp.status_code != 200:
            raise ConsoleClientError(f"{self.url}{path}: {_error_text(resp)}")
        return resp.json()

    def connect(self, progress: Progress) -> str:
        # a server still loading its model answers 503 {"status": "loading"}: wait with it
        while (health := self._get("/health", ok_while_loading=True)).get("status") == "loading":
            time.sleep(0.5)
        if health.get("status") != "ok":
            raise ConsoleClientError(f"{self.url} is not serving: {health}")
        props = self._get("/props")
        name = props.get("model") or props.get("model_path") or "model"
        stored = f", {props['kv_cache_dtype']}" if "kv_cache_dtype" in props else ""
        pool = (f" · {props['kv_pool_tokens']:,} K/V tokens ({props['kv_pool_bytes'] / 2**30:.1f} GiB{stored})"
                if "kv_pool_bytes" in props else "")
        return (f"{name} · {self.url}{context(props.get('max_model_len'), props.get('rope_scaling'))}{pool}"
                f"{restored(props.get('restored_prefix_tokens', 0))}")

    def stream(self, messages: list[dict], *, temperature: float, max_tokens: int,
               client: str) -> ReplyStream:
        return _HttpReply(self, {
            "messages": messages, "stream": True, "temperature": temperature,
            "max_tokens": max_tokens, "user": client, "stream_options": {"include_usage": True}})

    def cancel(self, request_id: str) -> None:
        resp = self.http.delete(f"/v1/requests/{request_id}")
        if resp.status_code not in (200, 204, 404):   # 404: it finished meanwhile
            raise ConsoleClientError(f"cancel {request_id}: {_error_text(resp)}")

    def cancel_quietly(self, request_id: str | None) -> None:
        if request_id is not None:
            try:
                self.cancel(request_id)
            except (httpx.HTTPError, ConsoleClientError):
                pass   # the stream is closed anyway; the server cancels on disconnect

    def snapshot(self) -> EngineSnapshot:
        body = self._get("/v1/requests")
        names = {f.name for f in fields(RequestRow)}
        rows = tuple(RequestRow(**{k: v for k, v in row.items() if k in names})
                     for row in body.get("data", ()))
        return EngineSnapshot.from_fields(body.get("stats", {}), rows)

    def close(self) -> None:
        self.http.close()


@dataclass
class ReplyBuffer:
    """Reads one reply on its own thread into memory; the UI takes what arrived on its own clock.

    The stream is opened on that thread too (templating, an HTTP round trip), and a cancel that
    comes before it exists is applied as soon as it does."""

    open_stream: Callable[[], ReplyStream]
    clock: Callable[[], float] = time.monotonic
    stream: ReplyStream | None = None
    final: ReplyDelta | None = None
    tokens: int = 0
    started: float = 0.0
    first_token: float | None = None
    last_token: float | None = None
    _pending: list[str] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _cancelled: bool = False

    def start(self) -> None:
        self.started = self.clock()
        threading.Thread(target=self._run, name="console-reply", daemon=True).start()

    def _run(self) -> None:
        try:
            stream = self.open_stream()
            with self._lock:
                self.stream = stream
                cancelled = self._cancelled
            if cancelled:
                stream.cancel()
            for delta in stream:
                self._record(delta)
                if delta.finish_reason is not None:
                    return
            self._record(ReplyDelta(finish_reason="error", error="the reply ended without a finish"))
        except Exception as e:   # noqa: BLE001 - any failure must end the reply, not the thread silently
            self._record(ReplyDelta(finish_reason="error", error=f"{type(e).__name__}: {e}"))

    def _record(self, delta: ReplyDelta) -> None:
        now = self.clock()
        with self._lock:
            if delta.text or delta.completion_tokens > self.tokens:
                self.first_token = self.first_token or now
                self.last_token = now
            self.tokens = max(self.tokens, delta.completion_tokens)
            self._pending.append(delta.text)
            if delta.finish_reason is not None:
                self.final = delta

    def take(self) -> tuple[str, ReplyDelta | None]:
        """The text that arrived since the last call, and the final delta once there is one."""
        with self._lock:
            text, self._pending = "".join(self._pending), []
            return text, self.final

    def cancel(self) -> None:
        with self._lock:
            self._cancelled = True
            stream = self.stream
        if stream is not None:
            stream.cancel()

    def rates(self) -> tuple[float, float | None]:
        """(decode tok/s, time to first token in s)."""
        ttft = None if self.first_token is None else self.first_token - self.started
        span = (self.last_token or 0.0) - (self.first_token or 0.0)
        return ((self.tokens - 1) / span if self.tokens > 1 and span > 0 else 0.0), ttft
