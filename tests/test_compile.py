"""`compile = true` runs the model step under torch.compile (inductor) and changes no token."""
from __future__ import annotations

import pytest

from engine import LLM, SamplingParams


@pytest.mark.slow
def test_compiled_model_gives_the_eager_tokens(tiny_checkpoint, tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    path = str(tiny_checkpoint("qwen3", tied=False, heads=8, kv_heads=2, head_dim=32))
    prompts = [list(range(5, 25)), list(range(40, 47)), list(range(100, 133))]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    kw = dict(dtype="float32", max_model_len=128, kv_pool_tokens=1024)
    eager = LLM(model=path, **kw).generate(prompts, params)
    llm = LLM(model=path, compile=True, **kw)
    compiled = llm.generate(prompts, params)
    assert llm.engine.runner._compiled is not None
    assert [o.token_ids for o in compiled] == [o.token_ids for o in eager]
