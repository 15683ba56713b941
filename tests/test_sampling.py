"""Sampling's argmax (engine/sampling.py): the same index as torch's argmax, the first of the largest
values with NaN counting as the largest, whatever the row length and wherever the maximum lies."""
from __future__ import annotations

import pytest
import torch

from engine.sampling import ARGMAX_CHUNK, argmax


@pytest.mark.parametrize("n", [151936, 1000, 2 * ARGMAX_CHUNK + 1, 200])
def test_argmax_is_torchs(n):
    g = torch.Generator().manual_seed(n)
    x = torch.randn(5, n, generator=g)
    top = x.max() + 1
    x[1, [n // 3, n // 2, n - 1]] = top                  # ties across chunks: the first one wins
    x[2, [n - 2, n - 1]] = top                           # ties in the last, perhaps short, chunk
    x[3, n - 1] = top                                    # the very last value
    x[4] = float("-inf")
    x[4, [n // 5, n // 4]] = float("nan")                # NaN counts as the largest, the first one
    assert torch.equal(argmax(x), x.argmax(-1))
    assert argmax(x).tolist()[1:4] == [n // 3, n - 2, n - 1]
    assert torch.equal(argmax(x[0]), x[0].argmax())      # one row: a 0-d index
    assert argmax(torch.full((2, n), float("-inf"))).tolist() == [0, 0]


def test_argmax_of_many_random_rows():
    g = torch.Generator().manual_seed(0)
    for n in (257, 384, 4097, 32000):
        x = torch.randint(-50, 50, (64, n), generator=g).float()     # many ties
        assert torch.equal(argmax(x), x.argmax(-1)), n
