"""ops.pointwise: a value's result is the same bits wherever it sits in its tensor (so a token's gates do
not change with the tokens beside it in a step), and the same function as torch's up to rounding."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ops import pointwise

FUNCTIONS = {"sigmoid": (pointwise.sigmoid, torch.sigmoid), "silu": (pointwise.silu, F.silu),
             "softplus": (pointwise.softplus, F.softplus), "rsqrt": (pointwise.rsqrt, torch.rsqrt)}


def _inputs(name: str) -> torch.Tensor:
    x = torch.randn(4096, generator=torch.Generator().manual_seed(0)) * 8
    return x.abs() + 1e-6 if name == "rsqrt" else x


@pytest.mark.parametrize("name", FUNCTIONS)
def test_a_value_gets_the_same_bits_in_any_slice(name):
    ours, _ = FUNCTIONS[name]
    x = _inputs(name)
    whole = ours(x)
    for n in (1, 3, 7, 8, 9, 15, 16, 17, 33):      # vector bodies and scalar tails of every width
        for start in range(0, 512, n):
            assert torch.equal(ours(x[start:start + n]), whole[start:start + n]), (n, start)
    assert torch.equal(ours(x.view(64, 64))[5], whole[5 * 64:6 * 64])


@pytest.mark.parametrize("name", FUNCTIONS)
def test_the_same_function_as_torch(name):
    ours, theirs = FUNCTIONS[name]
    x = _inputs(name)
    torch.testing.assert_close(ours(x), theirs(x), rtol=4e-7, atol=1e-30)


def test_the_ends_of_the_range():
    x = torch.tensor([-200.0, -90.0, 0.0, 19.0, 21.0, 90.0, 200.0])
    torch.testing.assert_close(pointwise.sigmoid(x), torch.sigmoid(x))
    torch.testing.assert_close(pointwise.silu(x), F.silu(x))
    assert torch.equal(pointwise.softplus(x[4:]), x[4:])         # past the threshold: x itself, no overflow
    torch.testing.assert_close(pointwise.softplus(x), F.softplus(x))
    assert not any(f(x).isnan().any() for f in (pointwise.sigmoid, pointwise.silu, pointwise.softplus))
