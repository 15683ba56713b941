"""pagedserve's serving engine. `from engine import LLM, SamplingParams`.

Imports are lazy so that front ends (CLI help, config commands) never load torch.
"""
from engine.request import SamplingParams

__all__ = ["LLM", "SamplingParams"]


def __getattr__(name):
    if name == "LLM":
        from engine.llm import LLM
        return LLM
    raise AttributeError(name)
