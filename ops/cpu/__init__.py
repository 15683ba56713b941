"""C++ CPU kernels for pagedserve's hot ops; importing this package registers them over the torch bodies.

`ops._registry.impl` imports this package on the first CPU call. The extension is compiled on first use
(about a minute on 2 cores, cached under the user cache dir; ops/cpu/build.py, which also says how to build
for another CPU). Without a working compiler one line is logged and the torch bodies stay registered.
PAGEDSERVE_CPU_KERNELS=0 skips the build on purpose.

Ops with a kernel: paged_attention (decode and verify rows, and prefill rows on AVX-512 CPUs; K/V stored in
fp32, bf16 or fp16, or q8_0 / q4_0 tiles read with integer dot products, VNNI's on AVX-512 CPUs and VPMADDWD
on AVX2 ones; other prefill rows keep torch's SDPA),
write_kv (converting to the cache's dtype or quantizing), rotary, quant_linear (integer dot products; with
AMX-BF16, prefill-sized bf16 calls multiply bf16-dequantized weights in torch's GEMM), quant_rows, rms_norm,
add_rms_norm and silu_and_mul (these round where transformers does; only the order of the sum of squares, or
the exp, differs, so fp32 outputs may differ from the torch body by an ulp or two).
"""
from __future__ import annotations

import logging
import os
from typing import Callable

import torch
from torch import Tensor

from ops import kv_quant, paged_attention
from ops._registry import OpInputError, register, require
from ops.cpu import build
from ops.paged_attention import _check_lengths, _prefill_row, gather_kv, torch_paged_attention
from ops.dense_linear import SMALL_ROWS, torch_dense_linear
from ops.quant_linear import reference_quant_linear
from ops.quant_rows import reference_quant_rows
from ops.rms_norm import torch_add_rms_norm, torch_rms_norm
from ops.rotary import torch_rotary
from ops.silu_and_mul import torch_silu_and_mul
from ops.write_kv import KV_CACHE_DTYPES, torch_write_kv

log = logging.getLogger(__name__)
ENV_SWITCH = "PAGEDSERVE_CPU_KERNELS"
KERNEL_DTYPES = (torch.float32, torch.bfloat16)     # what the templated kernels are instantiated for
_lib = None                                         # torch.ops.pagedserve_cpu once loaded
INSTRUCTION_SETS: frozenset[str] = frozenset()     # what the loaded kernels were built for (install())
# Rows of up to this many new tokens (decode rows, speculative verify rows) are attended by the C++ kernel,
# one decode row per token, where SDPA's masked path was many times dearer. With AVX-512 kernels every row is
# (install() lifts the cap): the kernel beat torch's flash SDPA there at 512-token prefill chunks too.
# Elsewhere longer rows stay with SDPA, whose arithmetic serves many tokens per K/V value (the kernel's, one
# token).
KERNEL_ROW_TOKENS = 64
# The same cap for rows over a cache stored in q's own dtype. install() lifts it with the other only where
# the CPU has no AMX-BF16: with it torch's flash SDPA multiplies on the tiles, many query tokens per K/V
# read, and beat the kernel from 65-token rows on. Other caches (quantized, or narrower than q) stay with
# the kernel, which reads them as they are where SDPA would need a widened copy (but see QUANT_SDPA_TOKENS).
SAME_DTYPE_ROW_TOKENS = 64
# With AVX-512 a quantized cache's rows keep the kernel whatever their length, except, where install() finds
# AMX-BF16, a row of at least this many new tokens after paged_attention.SPLIT_PREFIX or more cached ones (a
# prefill chunk late in a long prompt): the prefix dequantized once (gather_kv.cpp) and flash SDPA's tile
# products beat the kernel, which reads the prefix once per token or two. Shorter rows, or a shorter prefix
# (SDPA's slower masked call), favour the kernel.
QUANT_SDPA_TOKENS = 2**31 - 1
# quant_linear calls with this many bf16 x rows or more (prefill chunks) dequantize the weights to bf16 and
# run torch's GEMM, which has AMX-BF16 tiles to run on where install() finds them (then it sets 128, about
# where the default model's layers broke even); elsewhere every call keeps the integer kernels. Fewer rows
# do not pay for dequantizing the whole weight, and verify rows (fewer) keep the integer kernels' bits.
DENSE_ROWS = 2**31 - 1
# Rows of more than this many new tokens, bf16 queries over a bf16 cache, go to prefill_attention.cpp, where
# install() finds AVX-512 BF16 but no AMX (which takes them to SDPA, above): it puts 16 tokens in a vector
# and needs no folds, where the kernel, a token at a time, folds every position's products across its lanes.
# Verify rows (fewer tokens) keep the kernel's bits.
LANES_ROW_TOKENS = 2**31 - 1


def cpp_paged_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, query_start_loc: Tensor,
                        context_lens: Tensor, block_tables: Tensor, scale: float) -> Tensor:
    stored = k_cache.dtype in KV_CACHE_DTYPES or kv_quant.format_of(k_cache, q.shape[2]) is not None
    if (q.dtype not in KERNEL_DTYPES or not stored or k_cache.stride(3) != 1
            or v_cache.stride() != k_cache.stride() or q.shape[2] % 2):
        return torch_paged_attention(q, k_cache, v_cache, query_start_loc, context_lens, block_tables, scale)
    row_tokens = min(KERNEL_ROW_TOKENS, SAME_DTYPE_ROW_TOKENS) if k_cache.dtype == q.dtype else KERNEL_ROW_TOKENS
    lanes = q.dtype == k_cache.dtype == torch.bfloat16 and q.shape[2] in (32, 64, 128, 256)
    if lanes:
        row_tokens = min(row_tokens, LANES_ROW_TOKENS)
    if k_cache.dtype == torch.uint8 and q.shape[0] >= QUANT_SDPA_TOKENS and _chunks_after_long_prefixes(
            query_start_loc, context_lens):
        row_tokens = min(row_tokens, QUANT_SDPA_TOKENS - 1)
    out, prefill = _lib.paged_attention_decode(q.contiguous(), k_cache, v_cache, query_start_loc, context_lens,
                                               block_tables, scale, 0, 0, row_tokens)
    if not prefill:              # the kernel's rows only, and their lengths checked by it
        return out
    starts, ctx = query_start_loc.tolist(), context_lens.tolist()
    if prefill < 0:              # the kernel refused the lengths: name the row
        _check_lengths(starts, ctx, q.shape[0], block_tables.shape[1] * k_cache.shape[1])
    for i, n_ctx in enumerate(ctx):
        n = starts[i + 1] - starts[i]
        if n <= row_tokens:
            continue
        if lanes and n > LANES_ROW_TOKENS:      # 16 tokens to a vector (see LANES_ROW_TOKENS)
            out[starts[i]:starts[i] + n] = _lib.prefill_attention(q[starts[i]:starts[i] + n].contiguous(), k_cache,
                                                                  v_cache, block_tables[i], n_ctx, scale)
        else:                                   # torch's flash-attention SDPA (see KERNEL_ROW_TOKENS)
            _prefill_row(out, q, k_cache, v_cache, starts[i], n, n_ctx, block_tables[i], scale, cpp_gather_kv)
    return out


def _chunks_after_long_prefixes(query_start_loc: Tensor, context_lens: Tensor) -> bool:
    """Whether some row has QUANT_SDPA_TOKENS new tokens or more and every such row follows SPLIT_PREFIX cached
    ones or more: one cap serves the whole call, so such a row after a shorter prefix keeps them all on the
    kernel (a CPU step's 512 prefill tokens rarely hold two rows that long)."""
    n = query_start_loc.diff()
    long_rows = n >= QUANT_SDPA_TOKENS
    prefixes = context_lens[long_rows] - n[long_rows]
    return bool(long_rows.any()) and bool((prefixes >= paged_attention.SPLIT_PREFIX).all())


def cpp_gather_kv(k_cache: Tensor, v_cache: Tensor, blocks: Tensor, dtype: torch.dtype,
                  head_dim: int) -> tuple[Tensor, Tensor]:
    if k_cache.dtype != torch.uint8 or dtype not in KERNEL_DTYPES:
        return gather_kv(k_cache, v_cache, blocks, dtype, head_dim)
    return _lib.gather_kv(k_cache, v_cache, blocks, head_dim, dtype == torch.bfloat16)


def cpp_write_kv(k_cache: Tensor, v_cache: Tensor, k: Tensor, v: Tensor, slot_mapping: Tensor) -> None:
    if k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        torch_write_kv(k_cache, v_cache, k, v, slot_mapping)
        return
    bad = _lib.write_kv(k_cache, v_cache, k, v, slot_mapping)
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    require(bad < 0, "write_kv", f"slot {bad} is past the cache's last slot {num_slots - 1} "
            "(slot = block * block_size + offset; use -1 for padding tokens)")


def cpp_rotary(q: Tensor, k: Tensor, positions: Tensor, cos_sin: Tensor, rotary_dim: int) -> tuple[Tensor, Tensor]:
    if q.dtype not in KERNEL_DTYPES:
        return torch_rotary(q, k, positions, cos_sin, rotary_dim)
    q_out, k_out, bad = _lib.rotary(q, k, positions, cos_sin, rotary_dim)
    require(bad < 0, "rotary", f"positions must lie in [0, {cos_sin.shape[0]}) (the cos_sin table's rows), "
            f"got {bad}; build a longer table with ops.rotary.rope_cos_sin")
    return q_out, k_out


def _norm_fits(x: Tensor, weight: Tensor) -> bool:
    return x.dtype in KERNEL_DTYPES and weight.dtype == x.dtype


def cpp_rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    if not _norm_fits(x, weight):
        return torch_rms_norm(x, weight, eps)
    return _lib.rms_norm(x.contiguous(), weight.contiguous(), eps)


def cpp_add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    if not _norm_fits(x, weight):
        return torch_add_rms_norm(x, residual, weight, eps)
    return _lib.add_rms_norm(x.contiguous(), residual.contiguous(), weight.contiguous(), eps)


def cpp_silu_and_mul(x: Tensor) -> Tensor:
    if x.dtype not in KERNEL_DTYPES:
        return torch_silu_and_mul(x)
    return _lib.silu_and_mul(x.contiguous())


def cpp_quant_linear(x: Tensor, qweight: Tensor, scales: Tensor, mins: Tensor | None, supers: Tensor | None,
                     bits: int, out_features: int) -> Tensor:
    if x.dtype == torch.bfloat16 and x.shape[0] >= DENSE_ROWS:
        return _lib.quant_dense_linear(x.contiguous(), qweight, scales, mins, supers, bits, out_features)
    return _lib.quant_linear(x.contiguous(), qweight, scales, mins, supers, bits, out_features)


def cpp_quant_rows(ids: Tensor, qweight: Tensor, scales: Tensor, mins: Tensor | None, supers: Tensor | None,
                   bits: int, out_features: int, dtype: torch.dtype) -> Tensor:
    if dtype not in KERNEL_DTYPES:
        return reference_quant_rows(ids, qweight, scales, mins, supers, bits, out_features, dtype)
    out, bad = _lib.quant_rows(ids.contiguous(), qweight, scales, mins, supers, bits, out_features,
                               dtype == torch.bfloat16)
    if bad >= 0:
        raise OpInputError(f"pagedserve::quant_rows: ids must lie in [0, {out_features}) (the weight's rows), "
                           f"got {int(ids[bad])}")
    return out


def cpp_dense_linear(x: Tensor, weight: Tensor) -> Tensor:
    if (x.shape[0] > SMALL_ROWS or x.dtype not in KERNEL_DTYPES or weight.dtype != x.dtype
            or not weight.is_contiguous()):
        return torch_dense_linear(x, weight)
    return _lib.dense_linear(x.contiguous(), weight)


CPP_BODIES: dict[str, Callable] = {"paged_attention": cpp_paged_attention, "write_kv": cpp_write_kv,
                                   "rotary": cpp_rotary, "quant_linear": cpp_quant_linear, "quant_rows": cpp_quant_rows,
                                   "rms_norm": cpp_rms_norm, "add_rms_norm": cpp_add_rms_norm,
                                   "silu_and_mul": cpp_silu_and_mul, "dense_linear": cpp_dense_linear}
TORCH_BODIES: dict[str, Callable] = {"paged_attention": torch_paged_attention, "write_kv": torch_write_kv,
                                     "rotary": torch_rotary, "quant_linear": reference_quant_linear,
                                     "quant_rows": reference_quant_rows,
                                     "rms_norm": torch_rms_norm, "add_rms_norm": torch_add_rms_norm,
                                     "silu_and_mul": torch_silu_and_mul, "dense_linear": torch_dense_linear}


def kernels_available() -> bool:
    return _lib is not None


def use_backend(backend: str) -> None:
    """Register the "cpp" or the "torch" bodies of the ops this package accelerates (for A/B runs)."""
    if backend not in ("cpp", "torch"):
        raise ValueError(f"backend {backend!r}: allowed are 'cpp' and 'torch'")
    if backend == "cpp" and _lib is None:
        raise RuntimeError("the C++ CPU kernels are not loaded (see the log line from ops.cpu); "
                           "use backend 'torch'")
    for op, fn in (CPP_BODIES if backend == "cpp" else TORCH_BODIES).items():
        register(op, "cpu")(fn)


def install() -> bool:
    """Load the extension (building it if needed) and register its kernels; on failure log one line and
    keep the torch bodies. Returns whether the C++ kernels are in use."""
    global _lib, INSTRUCTION_SETS, KERNEL_ROW_TOKENS, SAME_DTYPE_ROW_TOKENS, QUANT_SDPA_TOKENS, DENSE_ROWS, \
        LANES_ROW_TOKENS
    if os.environ.get(ENV_SWITCH, "1") == "0":
        use_backend("torch")
        return False
    if _lib is None:
        try:
            _lib = build.load_extension()
        except Exception as e:  # noqa: BLE001 - any build failure means: run the torch bodies
            reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
            log.warning("pagedserve: C++ CPU kernels unavailable (%s: %s); using the slower torch ops. "
                        "Needs g++ and ninja; set %s=0 to skip the build.", type(e).__name__, reason, ENV_SWITCH)
            use_backend("torch")
            return False
        INSTRUCTION_SETS = frozenset(filter(None, _lib.instruction_sets().split(",")))
        if "avx512" in INSTRUCTION_SETS:
            KERNEL_ROW_TOKENS = 2**31 - 1
        if "amx_bf16" in INSTRUCTION_SETS:
            DENSE_ROWS = 128
            QUANT_SDPA_TOKENS = 256
        else:
            SAME_DTYPE_ROW_TOKENS = KERNEL_ROW_TOKENS
            if "avx512_bf16" in INSTRUCTION_SETS:
                LANES_ROW_TOKENS = 64
    use_backend("cpp")
    return True


install()
