"""Which backend each pagedserve op runs on a device, and the Triton path through `torch.compile`.

There is no GPU here, so "a CUDA device" is simulated by patching the registry's device check: CPU tensors
then take the "cuda" backend, i.e. the Triton launchers, which the Triton interpreter runs on CPU.
Only the opaque `custom_op` path can be compiled this way: the `triton_op` twins that `expose_to_inductor`
adds for GPUs get decomposed by AOTAutograd, and the interpreter cannot run a kernel on the fake tensors of
that trace ("Attempted to access the data pointer on an invalid python storage"). Their CUDA decomposition
is exercised only by `make gpu-check`; here we check the rule leaves CPU tensors on the opaque path.
"""
from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"   # must precede the first import of the kernels (decided at @triton.jit)

import pytest  # noqa: E402
import torch  # noqa: E402

import ops  # noqa: E402,F401  (registers the pagedserve ops)
from ops import _registry  # noqa: E402
from ops.causal_conv1d import reference_causal_conv1d  # noqa: E402
from ops.gated_delta_rule import reference_gated_delta_rule  # noqa: E402
from ops.rotary import rope_cos_sin  # noqa: E402
from ops.silu_and_mul import reference_silu_and_mul  # noqa: E402
from ops.triton import KERNELS, expose_to_inductor  # noqa: E402

pagedserve = torch.ops.pagedserve


def test_cuda_tensors_dispatch_to_the_triton_kernels():
    for name, kernel in KERNELS.items():
        assert _registry.impl(name, torch.device("cuda")) is kernel
        assert _registry.impl(name, torch.device("cpu")) is not kernel


def test_every_triton_kernel_has_a_pagedserve_op():
    assert set(KERNELS) <= {name for name in dir(pagedserve) if not name.startswith("_")}


@pytest.fixture
def simulated_gpu(monkeypatch) -> list[str]:
    """Route CPU tensors to the "cuda" backend; returns the names of the Triton kernels that ran."""
    ran: list[str] = []
    monkeypatch.setattr(_registry, "backend_for", lambda device, op: "cuda")
    for name, kernel in KERNELS.items():
        def spy(*args, _name=name, _kernel=kernel, **kwargs):
            ran.append(_name)
            return _kernel(*args, **kwargs)
        monkeypatch.setitem(_registry._IMPLS, (name, "cuda"), spy)
    return ran


def test_op_on_a_gpu_device_runs_its_triton_kernel(simulated_gpu):
    x = torch.randn(3, 2 * 24, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(pagedserve.silu_and_mul(x), reference_silu_and_mul(x), atol=1e-6, rtol=1e-6)
    assert simulated_gpu == ["silu_and_mul"]


def _dense_step(x, residual, norm_w, qkv_w, k_cache, v_cache, positions, cos_sin, slots, qsl, ctx, tables, up_w):
    """One tiny attention + MLP block made only of pagedserve ops (4 q heads, 2 kv heads, head_dim 16)."""
    normed, residual = pagedserve.add_rms_norm(x, residual, norm_w, 1e-6)
    qkv = normed @ qkv_w
    q, k, v = qkv[:, :64].view(-1, 4, 16), qkv[:, 64:96].view(-1, 2, 16), qkv[:, 96:].view(-1, 2, 16)
    q, k = pagedserve.rotary(q, k, positions, cos_sin, 16)
    pagedserve.write_kv(k_cache, v_cache, k, v, slots)
    attended = pagedserve.paged_attention(q, k_cache, v_cache, qsl, ctx, tables, 0.25).flatten(1)
    return pagedserve.silu_and_mul(attended @ up_w) + residual[:, :32]


def _dense_inputs():
    g = torch.Generator().manual_seed(1)
    # rows: a 3-token prompt chunk after 14 cached tokens (crosses a page), a decode row, then 1 padding token
    lens, starts = [3, 1], [14, 5]
    tables = torch.tensor([[2, 0], [1, 3]], dtype=torch.int32)
    positions = torch.tensor([14, 15, 16, 5, 0])
    slots = torch.tensor([2 * 16 + 14, 2 * 16 + 15, 0 * 16 + 0, 1 * 16 + 5, -1])
    return dict(
        x=torch.randn(5, 64, generator=g), residual=torch.randn(5, 64, generator=g),
        norm_w=torch.rand(64, generator=g) + 0.5, qkv_w=torch.randn(64, 128, generator=g) * 0.2,
        k_cache=torch.randn(4, 16, 2, 16, generator=g), v_cache=torch.randn(4, 16, 2, 16, generator=g),
        positions=positions, cos_sin=rope_cos_sin(32, 16, 10000.0), slots=slots,
        qsl=torch.tensor([0, 3, 4], dtype=torch.int32),
        ctx=torch.tensor([s + n for s, n in zip(starts, lens)], dtype=torch.int32),
        tables=tables, up_w=torch.randn(64, 64, generator=g) * 0.2)


def test_compiled_dense_step_on_the_triton_kernels_matches_eager(simulated_gpu):
    expose_to_inductor()     # installed as on a GPU; CPU tensors must keep the opaque path through it
    eager_in, compiled_in = _dense_inputs(), _dense_inputs()
    expected = _dense_step(**eager_in)
    eager_calls = list(simulated_gpu)
    simulated_gpu.clear()
    actual = torch.compile(_dense_step, fullgraph=True, dynamic=False)(**compiled_in)
    assert simulated_gpu == eager_calls == ["add_rms_norm", "rotary", "write_kv", "paged_attention", "silu_and_mul"]
    torch.testing.assert_close(actual, expected, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(compiled_in["k_cache"], eager_in["k_cache"], atol=1e-5, rtol=1e-5)
    # and the CPU backend agrees with the Triton kernels on the same step
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_registry, "backend_for", lambda device, op: "cpu")
        torch.testing.assert_close(_dense_step(**_dense_inputs()), expected, atol=1e-4, rtol=1e-4)


def _hybrid_step(x, conv_w, conv_state, slots, qsl, g, beta, state_pool):
    mixed = pagedserve.causal_conv1d(x, conv_w, conv_state, qsl, slots, True)
    q, k, v = mixed[:, :8].view(-1, 1, 8), mixed[:, 8:16].view(-1, 1, 8), mixed[:, 16:].view(-1, 2, 4)
    return pagedserve.gated_delta_rule(q, k, v, g, beta, state_pool, qsl, slots, True) * 2


def _hybrid_inputs():
    gen = torch.Generator().manual_seed(2)
    return dict(x=torch.randn(6, 24, generator=gen), conv_w=torch.randn(24, 4, generator=gen),
                conv_state=torch.randn(3, 24, 3, generator=gen), slots=torch.tensor([1, -1, 0], dtype=torch.int32),
                qsl=torch.tensor([0, 3, 4, 5], dtype=torch.int32), g=-torch.rand(6, 2, generator=gen),
                beta=torch.rand(6, 2, generator=gen), state_pool=torch.randn(3, 2, 8, 4, generator=gen))


def test_compiled_hybrid_step_on_the_triton_kernels_matches_the_references(simulated_gpu):
    expose_to_inductor()
    inputs, expected_in = _hybrid_inputs(), _hybrid_inputs()
    actual = torch.compile(_hybrid_step, fullgraph=True, dynamic=False)(**inputs)
    assert simulated_gpu == ["causal_conv1d", "gated_delta_rule"]
    e = expected_in
    mixed = reference_causal_conv1d(e["x"], e["conv_w"], e["conv_state"], e["qsl"], e["slots"], True)
    q, k, v = mixed[:, :8].view(-1, 1, 8), mixed[:, 8:16].view(-1, 1, 8), mixed[:, 16:].view(-1, 2, 4)
    expected = reference_gated_delta_rule(q, k, v, e["g"], e["beta"], e["state_pool"], e["qsl"], e["slots"], True) * 2
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(inputs["conv_state"], e["conv_state"])
    torch.testing.assert_close(inputs["state_pool"], e["state_pool"], atol=1e-5, rtol=1e-5)
