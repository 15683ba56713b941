"""pagedserve's custom torch ops. `import ops` registers them; call them as `torch.ops.pagedserve.<name>(...)`
(checked inputs), or as `ops.direct.<name>(...)` from model code (see ops/_registry.py).

Each module holds one op (schema, fake impl, pure-torch `reference_<name>`, backend dispatch by device).
"""
from __future__ import annotations

from ops import (causal_conv1d, dense_linear, gated_delta_rule, moe, paged_attention, quant_linear, quant_rows,
                 rms_norm, rotary, silu_and_mul, write_kv)
from ops._registry import OpInputError, direct
from ops.rotary import rope_cos_sin

__all__ = ["OpInputError", "direct", "causal_conv1d", "dense_linear", "gated_delta_rule", "moe", "paged_attention",
           "quant_linear", "quant_rows", "rms_norm", "rope_cos_sin", "rotary", "silu_and_mul", "write_kv"]
