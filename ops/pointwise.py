"""Elementwise functions whose result for a value does not depend on where the value sits in its tensor.

ATen's CPU sigmoid, softplus, silu and rsqrt round a vector's body and its scalar tail differently, so a
token's gate or norm changed in its last bit with the number of tokens beside it in a step: a speculative
verify row got other bits than the decode steps it stands for, and a hybrid model's recurrent state carried
the difference on. exp, log1p, sqrt and division round alike everywhere, so these are written with them
(`tests/test_pointwise.py`)."""
from __future__ import annotations

import torch
from torch import Tensor

SOFTPLUS_THRESHOLD = 20.0      # above it softplus(x) is x in fp32, as torch's default threshold says


def sigmoid(x: Tensor) -> Tensor:
    return 1 / (1 + torch.exp(-x))


def silu(x: Tensor) -> Tensor:
    return x / (1 + torch.exp(-x))


def softplus(x: Tensor) -> Tensor:
    return torch.where(x > SOFTPLUS_THRESHOLD, x, torch.log1p(torch.exp(x)))


def rsqrt(x: Tensor) -> Tensor:
    return 1 / torch.sqrt(x)
