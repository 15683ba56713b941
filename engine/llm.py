"""The offline API: `LLM(model=..., **config).generate(prompts, params)` and `.chat(messages)`."""
from __future__ import annotations

from engine.builder import build_engine
from engine.config import make_engine_config
from engine.output import Completion
from engine.request import SamplingParams


class LLM:
    """Runs a list of prompts concurrently through the scheduler (in the calling thread)."""

    def __init__(self, model: str | None = None, **config):
        if model is not None:
            config["model"] = model
        self.engine = build_engine(make_engine_config(**config))
        self.tokenizer = self.engine.tokenizer

    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None
                 ) -> list[Completion]:
        """A prompt is a string or a list of token ids; outputs come back in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = params or SamplingParams()
        per_prompt = params if isinstance(params, list) else [params] * len(prompts)
        if len(per_prompt) != len(prompts):
            raise ValueError(f"{len(per_prompt)} SamplingParams for {len(prompts)} prompts")
        loop = self.engine.loop
        handles = []
        try:
            for prompt, sp in zip(prompts, per_prompt):
                handles.append(loop.submit(self._ids(prompt), sp, bounded=False))
        except Exception:
            for h in handles:       # one bad prompt fails the call, and leaves nothing queued
                h.cancel()
            loop.run_until_idle()
            raise
        loop.run_until_idle()
        return [h.result() for h in handles]

    def chat(self, messages, params: SamplingParams | None = None) -> Completion | list[Completion]:
        """`messages` is one conversation (a list of {"role", "content"}) or a list of them."""
        single = bool(messages) and isinstance(messages[0], dict)
        convs = [messages] if single else messages
        outs = self.generate([self.tokenizer.chat_ids(c) for c in convs], params)
        return outs[0] if single else outs

    def _ids(self, prompt) -> list[int]:
        return self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)

    def close(self) -> None:
        self.engine.close()
