"""EngineClient: the one object front ends (server, console) talk to. Text in, deltas out."""
from __future__ import annotations

from dataclasses import dataclass

from engine.builder import Engine, build_engine
from engine.config import EngineConfig
from engine.grammar import Grammar
from engine.output import RequestHandle
from engine.request import SamplingParams
from engine.stats import SchedulerStats


@dataclass(frozen=True)
class EngineInfo:
    """What /props and the console show about the running engine."""
    model: str
    model_path: str
    architecture: str
    dtype: str
    weights: str            # linear weights by format, e.g. "int4 g32x8 asym x84, int8 g32x8 sym x15"
    device: str
    max_model_len: int
    max_concurrency: int
    block_size: int
    num_blocks: int
    kv_pool_tokens: int
    kv_pool_bytes: int      # committed as blocks are first written, not at start; with a draft
                            # model's K/V under the same blocks
    kv_cache_dtype: str     # what the K/V cache stores, e.g. "bfloat16" (config kv_cache_dtype resolved)
    num_state_slots: int
    overlap_scheduling: bool    # each step planned while the one before runs (config resolved)
    vocab_size: int         # token ids run from 0 to vocab_size - 1
    sampling_defaults: dict  # the model's generation_config.json temperature, top_p, ...: what an
                             # HTTP request that leaves them out gets
    restored_prefix_tokens: int = 0     # cached tokens read back from prefix_cache_dir at the start
    rope_scaling: dict | None = None    # the rotary scaling served (rope_type, factor, the trained context
                                        # ...); None = plain rotary
    speculative: str = "none"           # the speculative decoding served: none, ngram or draft (config resolved)


class EngineClient:
    """Owns a running engine loop thread; every method is safe to call from any thread."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self._loop = engine.loop
        self._loop.start()

    @classmethod
    def from_config(cls, cfg: EngineConfig, progress=None) -> "EngineClient":
        return cls(build_engine(cfg, progress=progress))

    def submit(self, prompt: str | list[int] | None = None, *, messages: list[dict] | None = None,
               params: SamplingParams | None = None, request_id: str | None = None,
               client: str = "", after: str | None = None, timeout_s: float | None = None,
               group: str | None = None) -> RequestHandle:
        """Exactly one of `prompt` (text or token ids) and `messages` (chat, templated here).
        `after`, `timeout_s`, `group`: see EngineLoop.submit."""
        if (prompt is None) == (messages is None):
            raise ValueError("give exactly one of prompt and messages")
        if messages is not None:
            ids = self.tokenizer.chat_ids(messages)
        elif isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
        else:
            ids = list(prompt)
        return self._loop.submit(ids, params or SamplingParams(), request_id=request_id,
                                 client=client, after=after, timeout_s=timeout_s, group=group)

    def compile_grammar(self, grammar: Grammar) -> None:
        """Compile (and cache) a grammar now, so that submitting it later costs nothing; raises
        GrammarError. Slow for big grammars: call it off any thread that must stay responsive."""
        self._loop.grammars.compile(grammar)

    def grammar_literal(self, text: str) -> str:
        """`text` as a Lark grammar writes it for this tokenizer (GrammarCompiler.literal)."""
        return self._loop.grammars.literal(text)

    def cancel(self, request_id: str | None) -> None:
        """Stop a request, or all requests submitted with this `group`; None: everything live."""
        self._loop.cancel(request_id)

    def is_live(self, request_id: str) -> bool:
        """A request, or a group with a request, that has not finished."""
        return self._loop.is_live(request_id)

    def shed_waiting(self, error: str) -> None:
        """Cancel every request not yet started, `error` in its final delta."""
        self._loop.shed_waiting(error)

    @property
    def num_unfinished(self) -> int:
        """Requests submitted whose final delta has not been produced yet."""
        return self._loop.num_unfinished

    def stats(self) -> SchedulerStats:
        """A snapshot taken between two steps (it waits for the current step to end)."""
        return self._loop.stats()

    def info(self) -> EngineInfo:
        e = self.engine
        return EngineInfo(
            model=e.config.model, model_path=e.model_path,
            architecture=e.model_config.architecture, dtype=str(e.dtype).removeprefix("torch."),
            weights=e.weights, device=str(e.device), max_model_len=e.max_model_len,
            max_concurrency=e.config.max_concurrency, block_size=e.pool.shape.block_size,
            num_blocks=e.pool.num_blocks, kv_pool_tokens=e.pool.num_blocks * e.pool.shape.block_size,
            kv_pool_bytes=e.pool.nbytes + (e.draft.pool.nbytes if e.draft else 0),
            kv_cache_dtype=str(e.pool.shape.dtype).removeprefix("torch."),
            num_state_slots=e.state_pool.num_slots if e.state_pool is not None else 0,
            overlap_scheduling=e.scheduler.overlapped, vocab_size=e.model_config.vocab_size,
            sampling_defaults=dict(e.sampling_defaults),
            restored_prefix_tokens=e.snapshot.restored * e.pool.shape.block_size if e.snapshot else 0,
            rope_scaling=e.model_config.rope_params, speculative=e.speculative)

    def close(self) -> None:
        """Cancel what is live, stop the loop thread and save the prefix cache where it is kept."""
        self.engine.close()
