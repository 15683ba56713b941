"""What every pagedserve op shares: the typed input error and the one place that picks a backend."""
from __future__ import annotations

import torch

NAMESPACE = "pagedserve"


class OpInputError(ValueError):
    """An op was called with tensors it cannot use; the message names the argument and what is allowed."""


def require(ok: bool, op: str, message: str) -> None:
    if not ok:
        raise OpInputError(f"pagedserve::{op}: {message}")


def backend_for(device: torch.device, op: str) -> str:
    """Return "cpu" for CPU tensors; GPU backends are not wired in yet, so say so instead of failing later."""
    if device.type == "cpu":
        return "cpu"
    if device.type == "cuda":
        raise NotImplementedError("Triton kernels land with the GPU issue")
    raise OpInputError(f"pagedserve::{op}: tensors on device {device.type!r}; allowed: cpu (cuda later)")
