"""The server's side of the engine: loads it on a thread (so /health answers 503 meanwhile),
submits requests with errors mapped to HTTP and drains on shutdown. Requests in flight are the
engine loop's records (engine/output.py); a completion's choices are one group there."""
from __future__ import annotations

import dataclasses
import fnmatch
import logging
import os
import threading
from typing import Callable

from engine.config import EngineConfig, ServerConfig
from server import reasoning, tool_parsers
from server.errors import APIError
from server.metrics import ServerMetrics
from engine.stats import SchedulerStats

log = logging.getLogger("pagedserve.server")
# The final delta's error of a request cancelled by shutdown before it started: answered 503.
SHED = "the server is shutting down; the request was not started"


def is_pattern(alias: str) -> bool:
    """An alias with shell wildcards (`claude-*`) accepts the names it matches; it is never listed."""
    return any(c in alias for c in "*?[")


def served_names(model: str, aliases: tuple[str, ...] = ()) -> tuple[str, ...]:
    """The names the `model` field may use and /v1/models lists, the first the default: the
    configured aliases less the patterns, else the model's own name (a preset name, or a file's or
    directory's name, never its path)."""
    plain = tuple(dict.fromkeys(a for a in aliases if not is_pattern(a)))
    return plain or (os.path.basename(model.rstrip("/\\")) or model,)


def host_of(request) -> "EngineHost":
    """The app's EngineHost (server/app.py keeps it in app.state)."""
    return request.app.state.host


def client_label(request, user: str | None) -> str:
    """Who asked, for the request table: the `user` field, else the HTTP peer ip:port."""
    if user:
        return user
    peer = request.client
    return f"{peer.host}:{peer.port}" if peer else ""


class EngineHost:
    def __init__(self, engine_cfg: EngineConfig, server_cfg: ServerConfig,
                 build: Callable[[EngineConfig], object] | None = None):
        self.engine_cfg = engine_cfg
        self.server_cfg = server_cfg
        aliases = server_cfg.served_model_name
        self.names = served_names(engine_cfg.model, aliases)
        self._patterns = tuple(a for a in aliases if is_pattern(a))
        # without plain aliases the spec itself (a path, say) is still accepted, just never listed
        self._accepted = set(self.names) | (set() if any(not is_pattern(a) for a in aliases) else {engine_cfg.model})
        self.client = None
        self.info = None                      # engine.client.EngineInfo once loaded
        self.load_error: str | None = None
        self.draining = False
        self.metrics = ServerMetrics(self.stats)
        self._build = build
        self._loader: threading.Thread | None = None

    # -- lifecycle
    def start_loading(self, on_failure: Callable[[], None]) -> None:
        def load() -> None:
            try:
                build = self._build
                if build is None:
                    from engine.client import EngineClient   # torch: loaded off the event loop
                    build = EngineClient.from_config
                client = build(self.engine_cfg)
                self.info = client.info()
                self.client = client
                log.info("model %s ready", self.engine_cfg.model)
            except Exception as exc:  # noqa: BLE001 - any load failure ends the server with its message
                self.load_error = f"{type(exc).__name__}: {exc}"
                log.error("could not load %s: %s", self.engine_cfg.model, self.load_error)
                on_failure()
        self._loader = threading.Thread(target=load, name="pagedserve-load", daemon=True)
        self._loader.start()

    @property
    def ready(self) -> bool:
        return self.client is not None and not self.draining

    def drain(self) -> None:
        """Stop admitting; cancel queued requests (their clients get 503); running ones go on."""
        self.draining = True
        if self.client is not None:
            self.client.shed_waiting(SHED)

    @property
    def in_flight(self) -> int:
        """Engine requests not finished yet."""
        return 0 if self.client is None else self.client.num_unfinished

    def cancel_all(self) -> None:
        if self.client is not None:
            self.client.cancel(None)

    def close(self) -> None:
        if self.client is not None:
            self.client.close()

    # -- requests
    def require_client(self, admitting: bool = True):
        """The engine client; 503 while loading, and while draining when `admitting` new work."""
        if self.draining and admitting:
            raise APIError(503, "the server is shutting down; retry on another instance",
                           code="shutting_down")
        if self.client is None:
            detail = f"failed: {self.load_error}" if self.load_error else "is still loading"
            raise APIError(503, f"model {self.engine_cfg.model} {detail}; retry when GET /health "
                                "answers 200", code="model_loading")
        return self.client

    @property
    def tool_format(self) -> str | None:
        """The tool-call format replies are parsed in (server/tool_parsers.py), or None."""
        return self._parser(self.server_cfg.tool_call_parser, tool_parsers.parser_for_template)

    @property
    def reasoning_parser(self) -> str | None:
        """"qwen3" when <think> blocks are split into reasoning_content, else None."""
        return self._parser(self.server_cfg.reasoning_parser, reasoning.parser_for_template)

    def _parser(self, setting: str, from_template: Callable[[str | None], str | None]) -> str | None:
        if setting == "auto":
            return from_template(self.require_client(admitting=False).tokenizer.chat_template)
        return None if setting == "none" else setting

    def accept(self, body):
        """A generation request's first checks, in this order: the model it names, the engine
        ready (503 while loading or draining), then the body's fields. Returns the engine client."""
        self.check_model(body.model)
        client = self.require_client()
        body.check_fields()
        return client

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in self._accepted and not any(
                fnmatch.fnmatchcase(name, p) for p in self._patterns):
            served = " or ".join(repr(n) for n in self.names + self._patterns)
            raise APIError(404, f"model {name!r} is not served here; use {served} (GET /v1/models)",
                           param="model", code="model_not_found")

    def check_token_ids(self, ids: list[int], param: str) -> None:
        self.require_client()
        vocab = self.info.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"token id {bad[0]} is out of range; ids must be in [0, {vocab})",
                           param=param, code="invalid_value")

    def choices(self, body, prompt_len: int, grammar=None) -> list:
        """SamplingParams for each of a request body's choices (server/schemas.py
        SamplingBody): the model's defaults for fields left out, the rest of the context when no
        limit is set; seeded choices use seed + index, as the OpenAI docs ask."""
        info = self.info
        for token_id in body.logit_bias_ids():
            if not 0 <= token_id < info.vocab_size:
                raise APIError(400, f"logit_bias names token id {token_id}; ids must be in "
                                    f"[0, {info.vocab_size})", param="logit_bias", code="invalid_value")
        base = body.sampling_params(defaults=info.sampling_defaults,
                                    max_tokens=max(1, info.max_model_len - prompt_len), grammar=grammar)
        return [base if base.seed is None else dataclasses.replace(base, seed=base.seed + i)
                for i in range(body.choices)]

    def submit(self, completion_id: str, prompt_ids: list[int], params: list, *, client: str,
               param: str = "prompt") -> list:
        """One engine request per choice (params[i] for choice i); choices after the first start
        from the first's cached prompt blocks. Rejections are 400/503 naming `param`."""
        from engine.grammar import GrammarError
        from engine.errors import PromptTooLong, QueueFull, RequestRejected
        engine = self.require_client()
        handles: list = []
        try:
            for i, choice_params in enumerate(params):
                handles.append(engine.submit(prompt_ids, params=choice_params,
                                             request_id=completion_id if i == 0 else f"{completion_id}-{i}",
                                             client=client, after=completion_id if i else None,
                                             group=completion_id,
                                             timeout_s=self.server_cfg.request_timeout_s or None))
        except (QueueFull, RequestRejected, GrammarError) as e:
            for handle in handles:
                handle.cancel()
            if isinstance(e, QueueFull):
                raise APIError(503, str(e), code="queue_full") from None
            code = "context_length_exceeded" if isinstance(e, RequestRejected) else "invalid_value"
            # Anthropic's wording: Claude Code reads the two numbers, drops that many tokens of the
            # oldest turns and retries (OpenAI-style clients go by the code)
            too_long = (f"prompt is too long: {e.tokens} tokens > {e.most} maximum; {e}"
                        if isinstance(e, PromptTooLong) else None)
            raise APIError(400, str(e), param=param, code=code, anthropic_message=too_long) from None
        return handles

    def cancel(self, request_id: str) -> bool:
        """Cancel a completion (all its choices) or any engine request by id."""
        if self.client is None:
            return False
        known = self.client.is_live(request_id)
        if known:
            self.client.cancel(request_id)
        return known

    def stats(self) -> SchedulerStats | None:
        return self.client.stats() if self.client is not None else None
