"""What this machine can do at best, measured at the start of the run: memory bandwidth and bf16 GEMM
rate, and from them the decode roofline (a decode step must stream every weight once)."""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass

import torch

ROOFLINE_THREADS = 2        # the target machines have 2 cores


@dataclass(frozen=True)
class MachineRoofline:
    bandwidth_gb_s: float       # best observed, reading + writing counted
    gemm_gflop_s: float         # bf16, best observed
    gemm_size: int              # n of the n x n x n matmul that measured it
    threads: int

    def decode_step_s(self, *, weight_bytes: int, kv_bytes: int = 0) -> float:
        """Least time for one decode step: every weight and the rows' K/V (`kv_bytes` in total)
        streamed once at full bandwidth. Compute is left out: at decode batch sizes a GEMM row
        costs far less than its weights' traffic (and bf16 square-GEMM rates on CPUs without a
        fast path say nothing about the skinny GEMMs of a decode step)."""
        return (weight_bytes + kv_bytes) / (self.bandwidth_gb_s * 1e9)

    def decode_tok_s(self, *, weight_bytes: int, batch: int, kv_bytes: int = 0) -> float:
        return batch / self.decode_step_s(weight_bytes=weight_bytes, kv_bytes=kv_bytes)

    def gemm_tok_s(self, *, flops: float, tokens: int) -> float:
        """Tokens a second if a step's `flops` (for `tokens` tokens) ran at the probe's GEMM rate: the
        ceiling of batched decode and of prefill, where compute, not the weight stream, binds."""
        return tokens * self.gemm_gflop_s * 1e9 / flops


def decoder_flops(cfg, *, tokens: int, attended: int, logit_rows: int) -> float:
    """Multiply-adds x 2 of a dense decoder step: `tokens` through every linear layer, `attended` (query,
    key) pairs summed over the step's tokens (q.k and p.v for each), and `logit_rows` through the head."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    h = cfg.hidden_size
    per_token = h * (q + 2 * kv) + q * h + 3 * h * cfg.intermediate_size
    return 2.0 * (cfg.num_layers * (tokens * per_token + attended * 2 * q) + logit_rows * cfg.vocab_size * h)


@contextmanager
def torch_threads(n: int):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _best_time(fn, repeats: int) -> float:
    fn()                                                     # first touch / warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    # the machine is shared: the fastest run is the closest to what the hardware can do
    return min(times)


def measure_bandwidth_gb_s(mib: int = 256, repeats: int = 5) -> float:
    """A large tensor copy (read + write) and sum (read): the better of the two, in GB/s."""
    n = mib * 2**20 // 4
    src = torch.rand(n, dtype=torch.float32)
    dst = torch.empty_like(src)
    copy_s = _best_time(lambda: dst.copy_(src), repeats)
    sum_s = _best_time(lambda: src.sum(), repeats)
    nbytes = src.numel() * src.element_size()
    return max(2 * nbytes / copy_s, nbytes / sum_s) / 1e9


def measure_gemm_gflop_s(n: int = 2048, repeats: int = 5, dtype: torch.dtype = torch.bfloat16,
                         budget_s: float = 5.0) -> tuple[float, int]:
    """(GFLOP/s, size used) of an n x n x n matmul. Some CPUs have no fast path for bf16 (~1
    GFLOP/s without AVX-512): the size then shrinks until the measurement fits `budget_s`."""
    size = 256
    while True:
        a = torch.randn(size, size, dtype=dtype)
        b = torch.randn(size, size, dtype=dtype)
        t0 = time.perf_counter()
        a @ b
        once = time.perf_counter() - t0
        if size >= n or 8 * once * (repeats + 1) > budget_s:    # the next size costs 8x
            return 2 * size**3 / _best_time(lambda: a @ b, repeats) / 1e9, size
        size *= 2


def measure_machine(threads: int = ROOFLINE_THREADS, dtype: torch.dtype = torch.bfloat16
                    ) -> MachineRoofline:
    with torch_threads(threads), torch.inference_mode():
        gflop_s, size = measure_gemm_gflop_s(dtype=dtype)
        return MachineRoofline(bandwidth_gb_s=measure_bandwidth_gb_s(), gemm_gflop_s=gflop_s,
                               gemm_size=size, threads=threads)

