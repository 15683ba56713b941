"""Sampling parameters, finish reasons, the request lifecycle and the events a step makes of it (no
torch)."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from engine.errors import UserError
from engine.grammar import Grammar

LOGIT_BIAS_LIMIT = 100.0      # OpenAI's range: a bias outside it is clamped
GREEDY_BELOW = 1e-5           # a temperature under this draws greedily


class FinishReason(str, enum.Enum):
    STOP = "stop"          # EOS, a stop token id or a stop string
    LENGTH = "length"      # max_tokens or the end of the context
    TIMEOUT = "timeout"    # still generating when its time limit ran out (APIs call it length)
    CANCELLED = "cancelled"
    ERROR = "error"


class SamplingError(UserError, ValueError):
    """A sampling parameter is out of range; the message names it and what is allowed, `param`
    is its name."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0          # 0 = greedy
    top_k: int = 0                    # 0 = off
    top_p: float = 1.0
    min_p: float = 0.0
    max_tokens: int = 256
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None       # top-N logprobs per sampled token (0 = only the sampled one)
    grammar: Grammar | None = None    # the output must match it (engine/grammar.py)
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit), clamped to ±100

    def __post_init__(self) -> None:
        # accept lists/str from callers, store tuples so params stay hashable and immutable
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        object.__setattr__(self, "logit_bias", tuple(sorted(
            (int(t), max(-LOGIT_BIAS_LIMIT, min(LOGIT_BIAS_LIMIT, float(b)))) for t, b in bias)))
        checks = [
            ("temperature", self.temperature >= 0, "must be >= 0 (0 = greedy)"),
            ("top_k", self.top_k >= 0 or self.top_k == -1, "must be >= 0 (0 or -1 = off)"),
            ("top_p", 0 < self.top_p <= 1, "must be in (0, 1]"),
            ("min_p", 0 <= self.min_p <= 1, "must be in [0, 1]"),
            ("max_tokens", self.max_tokens >= 1, "must be >= 1"),
            ("min_tokens", 0 <= self.min_tokens <= self.max_tokens, "must be in [0, max_tokens]"),
            # beyond these, logits divided or multiplied by the penalty overflow
            ("repetition_penalty", 0.01 <= self.repetition_penalty <= 100, "must be in [0.01, 100] (1 = off)"),
            ("presence_penalty", -2 <= self.presence_penalty <= 2, "must be in [-2, 2]"),
            ("frequency_penalty", -2 <= self.frequency_penalty <= 2, "must be in [-2, 2]"),
            ("logprobs", self.logprobs is None or 0 <= self.logprobs <= 20, "must be in [0, 20]"),
        ]
        for name, ok, allowed in checks:
            if not ok:
                raise SamplingError(f"{name}={getattr(self, name)!r} {allowed}", name)
        if any(not s for s in self.stop):
            raise SamplingError("stop strings must not be empty", "stop")
        if any(t < 0 for t, _ in self.logit_bias):
            raise SamplingError(f"logit_bias: token id {self.logit_bias[0][0]} is negative; ids are >= 0",
                                "logit_bias")
        if len({t for t, _ in self.logit_bias}) != len(self.logit_bias):
            raise SamplingError("logit_bias names a token id twice", "logit_bias")

    @property
    def greedy(self) -> bool:
        # below this, logits / temperature overflows to inf and the draw to NaN (vLLM draws the same line)
        return self.temperature < GREEDY_BELOW

    @property
    def shaped(self) -> bool:
        """Logits change before the draw: penalties or a logit bias."""
        return self.penalized or bool(self.logit_bias)

    @property
    def penalized(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)


class RequestState(str, enum.Enum):
    WAITING = "waiting"    # queued (new, or preempted and waiting to recompute)
    PREFILL = "prefill"    # admitted, feeding all_token_ids in chunks
    DECODE = "decode"      # one token per step
    PAUSED = "paused"      # a decoder whose consumer is behind: keeps its blocks, gets no rows
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """One generation. The scheduler owns every field after `Scheduler.add`."""
    id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams = field(default_factory=SamplingParams)
    eos_token_ids: tuple[int, ...] = ()
    arrival_time: float | None = None         # set by Scheduler.add from its clock when None
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0              # tokens of all_token_ids already in the K/V cache
    num_cached_tokens: int | None = None      # prompt tokens its first admission found in the prefix cache
    state: RequestState = RequestState.WAITING
    finish_reason: FinishReason | None = None
    error: str | None = None
    blocks: list = field(default_factory=list)  # BlockHandle per block, in position order
    state_slot: int | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    preemptions: int = 0
    max_tokens: int = 0                       # params.max_tokens clamped to the context and pool
    pause_requested: bool = False             # paused by the consumer; applies once it decodes
    client: str = ""                          # who asked: a console session, an HTTP peer
    matcher: object | None = None             # engine.grammar's (Lazy)Matcher when params.grammar is set
    after: str | None = None                  # admitted once this request's prompt is computed, so
                                              # it starts from that prompt's cached blocks (n > 1)

    def __post_init__(self) -> None:
        self.prompt_token_ids = tuple(int(t) for t in self.prompt_token_ids)
        self.eos_token_ids = tuple(int(t) for t in self.eos_token_ids)
        self.max_tokens = self.max_tokens or self.params.max_tokens
        # appended to as tokens and blocks come, never rebuilt: a step's work stays independent
        # of how long the request has run
        self._all_ids = list(self.prompt_token_ids) + self.output_token_ids
        self._block_ids = [h.block_id for h in self.blocks]
        self.sent_blocks: int | None = None   # block ids the engine holds; None: it holds no record
        self.unsent_drop = 0                  # of those, how many the next row tells it to drop

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt then output (read-only: append_output adds to it)."""
        return self._all_ids

    def append_output(self, token: int) -> None:
        self.output_token_ids.append(token)
        self._all_ids.append(token)

    def set_last_output(self, token: int) -> None:
        """The last generated token, appended before it was known (overlapped scheduling), is `token`."""
        self.output_token_ids[-1] = self._all_ids[-1] = token

    def truncate_output(self, n: int) -> None:
        """Keep the first `n` generated tokens (a stop string ended a run of accepted ones)."""
        del self._all_ids[len(self.prompt_token_ids) + n:]
        del self.output_token_ids[n:]

    @property
    def block_ids(self) -> list[int]:
        """Block ids in position order (read-only: add_blocks / take_blocks change them)."""
        return self._block_ids

    def add_blocks(self, handles) -> None:
        self.blocks.extend(handles)
        self._block_ids.extend(h.block_id for h in handles)

    def take_blocks(self, keep: int = 0) -> list:
        """Remove and return the block handles past the first `keep`; the engine drops those it
        holds with the request's next row."""
        handles = self.blocks[keep:]
        del self.blocks[keep:], self._block_ids[keep:]
        if self.sent_blocks is not None and self.sent_blocks > keep:
            self.unsent_drop += self.sent_blocks - keep
            self.sent_blocks = keep
        return handles

    def finished_by_last_token(self, max_model_len: int) -> FinishReason | None:
        """Whether the token just appended ends the request, and why."""
        out = self.output_token_ids
        # a stop id counts only when drawn unbanned (min_tokens already generated before it)
        if len(out) > min(self.params.min_tokens, self.max_tokens - 1) and out[-1] in self.stop_token_ids:
            return FinishReason.STOP
        if self.matcher is not None and self.matcher.done:   # complete: nothing but EOS could follow
            return FinishReason.STOP
        if len(out) >= self.max_tokens or len(self._all_ids) >= max_model_len:
            return FinishReason.LENGTH
        return None

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """Token ids that end this request (EOS unless ignore_eos, plus params.stop_token_ids)."""
        eos = () if self.params.ignore_eos else self.eos_token_ids
        return eos + self.params.stop_token_ids


@dataclass(frozen=True)
class Event:
    """What one step (or a cancel/finish) did to one request."""
    request_id: str
    token: int | None
    finished: FinishReason | None
    error: str | None
    prompt_tokens: int
    generated_tokens: int
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()

    @classmethod
    def of(cls, req: Request, reason: FinishReason | None, error: str | None, out=None) -> "Event":
        """`req` as it stands, with `out`'s token and logprobs (a RowOutput or Draw) if given."""
        return cls(req.id, None if out is None else out.token, reason, error,
                   len(req.prompt_token_ids), len(req.output_token_ids),
                   None if out is None else out.logprob, () if out is None else out.top_logprobs)
