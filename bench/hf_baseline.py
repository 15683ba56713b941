"""The transformers baseline: the same weights, static batches, greedy `generate` with EOS ignored."""
from __future__ import annotations

import time

import torch


def load_hf_model(path, dtype: torch.dtype):
    from transformers import Qwen3ForCausalLM

    return Qwen3ForCausalLM.from_pretrained(path, dtype=dtype).eval()


def hf_generate_s(model, prompts: list[list[int]], new_tokens: int) -> float:
    """Seconds for one static-batch `generate` of exactly `new_tokens` tokens per prompt (all
    prompts have the same length, so there is no padding)."""
    ids = torch.tensor(prompts, dtype=torch.int64)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             pad_token_id=model.config.pad_token_id)
    elapsed = time.perf_counter() - start
    if out.shape[1] != ids.shape[1] + new_tokens:
        raise RuntimeError(f"transformers generated {out.shape[1] - ids.shape[1]} tokens, "
                           f"asked for {new_tokens}")
    return elapsed
