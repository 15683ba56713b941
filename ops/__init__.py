"""pagedserve's custom torch ops. `import ops` registers them; call them as `torch.ops.pagedserve.<name>(...)`.

Each module holds one op (schema, fake impl, pure-torch `reference_<name>`, backend dispatch by device).
"""
from __future__ import annotations

from ops import (causal_conv1d, gated_delta_rule, moe, paged_attention, rms_norm, rotary, silu_and_mul,
                 write_kv)
from ops._registry import OpInputError
from ops.rotary import rope_cos_sin

__all__ = ["OpInputError", "causal_conv1d", "gated_delta_rule", "moe", "paged_attention", "rms_norm", "rope_cos_sin",
           "rotary", "silu_and_mul", "write_kv"]
