"""What every pagedserve op shares: the typed input error and the one place that picks a backend."""
from __future__ import annotations

import importlib
from typing import Callable

import torch

NAMESPACE = "pagedserve"


class OpInputError(ValueError):
    """An op was called with tensors it cannot use; the message names the argument and what is allowed."""


def require(ok: bool, op: str, message: str) -> None:
    if not ok:
        raise OpInputError(f"pagedserve::{op}: {message}")


def require_slot_rows(op: str, state_slots: torch.Tensor, query_start_loc: torch.Tensor) -> None:
    """The recurrent ops' row layout: one int32 state slot per row and int32 [B+1] row starts."""
    rows = state_slots.shape[0] if state_slots.dim() == 1 else -1
    require(state_slots.dtype == torch.int32 and rows >= 0, op,
            f"state_slots must be int32 [B], got {state_slots.dtype} {tuple(state_slots.shape)}")
    require(query_start_loc.dtype == torch.int32 and query_start_loc.shape == (rows + 1,), op,
            f"query_start_loc must be int32 [B+1={rows + 1}], got {query_start_loc.dtype} "
            f"{tuple(query_start_loc.shape)}")


def require_checkpoints(op: str, checkpoints: torch.Tensor | None, checkpoint_start: torch.Tensor | None,
                        state: torch.Tensor, state_slots: torch.Tensor) -> None:
    """The recurrent ops' optional per-token state record: `checkpoints` [C, *slot shape] in the state's
    dtype and int32 `checkpoint_start` [B] (-1 = the row records nothing), given together."""
    if checkpoints is None and checkpoint_start is None:
        return
    require(checkpoints is not None and checkpoint_start is not None, op,
            "checkpoints and checkpoint_start go together: pass both or neither")
    shape = tuple(state.shape[1:])
    require(checkpoints.dim() == state.dim() and tuple(checkpoints.shape[1:]) == shape
            and checkpoints.dtype == state.dtype, op,
            f"checkpoints must be {state.dtype} [C, {', '.join(map(str, shape))}] like one state slot, "
            f"got {checkpoints.dtype} {tuple(checkpoints.shape)}")
    require(checkpoint_start.dtype == torch.int32 and checkpoint_start.shape == state_slots.shape, op,
            f"checkpoint_start must be int32 [B={state_slots.shape[0]}], got {checkpoint_start.dtype} "
            f"{tuple(checkpoint_start.shape)}")


def checkpoint_rows(checkpoints: torch.Tensor | None, checkpoint_start: torch.Tensor | None, starts: list[int],
                    op: str) -> list[int]:
    """Each row's first checkpoint index on the host (-1: none), checked against the buffer's size."""
    rows = len(starts) - 1
    if checkpoints is None:
        return [-1] * rows
    first = checkpoint_start.tolist()
    over = [i for i, c in enumerate(first) if c >= 0 and c + starts[i + 1] - starts[i] > checkpoints.shape[0]]
    require(not over, op, f"row {over[0] if over else 0} records its states past the {checkpoints.shape[0]} "
                          "checkpoints given: size checkpoints for every recorded token")
    return first


_IMPLS: dict[tuple[str, str], Callable] = {}
_BACKEND_PACKAGES = {"cpu": "ops.cpu", "cuda": "ops.triton"}
_loaded: set[str] = set()


def register(op: str, backend: str) -> Callable[[Callable], Callable]:
    """Register `fn` as the body of `pagedserve::op` on `backend` ("cpu" or "cuda"). A later
    registration replaces an earlier one: the op files register torch code, and backend packages
    (ops.cpu's C++ kernels, ops.triton's kernels) replace it when they can run here."""
    def deco(fn: Callable) -> Callable:
        _IMPLS[(op, backend)] = fn
        return fn
    return deco


def backend_for(device: torch.device, op: str) -> str:
    if device.type not in _BACKEND_PACKAGES:
        raise OpInputError(f"pagedserve::{op}: tensors on device {device.type!r}; allowed: cpu, cuda")
    return device.type


def impl(op: str, device: torch.device) -> Callable:
    """The registered body of `op` for tensors on `device`."""
    backend = backend_for(device, op)
    if backend not in _loaded:
        _loaded.add(backend)
        try:
            importlib.import_module(_BACKEND_PACKAGES[backend])
        except ModuleNotFoundError as e:
            if e.name != _BACKEND_PACKAGES[backend]:
                raise
    fn = _IMPLS.get((op, backend))
    if fn is None:
        raise NotImplementedError(f"pagedserve::{op} has no {backend} kernel yet")
    return fn


class _Direct:
    """`ops.direct.<op>(...)`: how model code calls pagedserve ops. Under torch.compile it is the
    registered custom op, which inductor sees; in eager mode it is the backend body itself, skipping
    custom_op's per-call Python dispatch and input checks (~70 us a call, measured here: on a CPU decode
    step of a 28-layer model, ~250 op calls, that is more time than the norms themselves take)."""

    def __getattr__(self, op: str) -> Callable:
        registered = getattr(getattr(torch.ops, NAMESPACE), op)
        label = f"{NAMESPACE}::{op}"

        def call(*args):
            if torch.compiler.is_compiling():
                return registered(*args)
            device = args[0].device
            # a backend already loaded answers from the table (this runs ~250 times a decode step)
            body = _IMPLS.get((op, device.type)) if device.type in _loaded else None
            body = body or impl(op, device)
            if torch.autograd.profiler._is_profiler_enabled:   # keep the op's name in profiles
                with torch.profiler.record_function(label):
                    return body(*args)
            return body(*args)
        setattr(self, op, call)
        return call


direct = _Direct()
