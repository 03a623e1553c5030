"""The ``*-master`` optimizer step in one fused pass over the FP32 masters and their states.

Under ``*-master`` the user's optimizer updates FP32 masters (see
:mod:`lightning_ext.masters`).  On CPU torch's default implementation of
``Adam``/``AdamW``/``SGD``/``Adagrad`` is the single-tensor loop: about ten
elementwise passes over every parameter (weight decay, ``lerp_``, ``mul_``,
``addcmul_``, ``sqrt``, ``div``, ``add_``, ``addcdiv_``...), each reading and
writing FP32 tensors from memory.  torch's *fused* kernels
(``torch._fused_adamw_`` and friends, ``fused=True``) read the gradient and the
states once and write the parameter and the states once.

:func:`fused_implementation` turns the fused kernel on for the duration of one
``optimizer.step()`` on the param groups where the user left the choice to
torch (``foreach=None`` and ``fused=None``: torch's own default picks an
implementation for them too) and where the kernel applies (dense FP32
parameters and gradients on a device torch has fused kernels for, not
``differentiable``/``capturable``, exact ``Adam``/``AdamW``/``SGD``/``Adagrad``
classes, whose ``step`` is torch's).  The step still runs through the user's
``optimizer.step()``: hooks, LR-scheduler bookkeeping, state creation and
checkpoints are torch's; the flag is restored right after, so a saved optimizer
state carries the user's settings.  An explicit ``foreach``/``fused`` setting is
left alone.  The update is the same rule; the fused kernel orders its floating
point operations differently, so results agree with the single-tensor loop to
FP32 rounding, not bit for bit.

What the masters' step reads and writes per parameter (bf16 weight, AdamW), with
``MasterWeights``' FP32 gradient copy before it and the write-back after it:

=================================  =========================================
pass                               bytes per parameter
=================================  =========================================
bf16 grad -> FP32 master grad      2 read + 4 written (one fused copy)
fused AdamW on the master          16 read (grad, master, m, v) + 12 written
FP32 master -> bf16 weight         4 read + 2 written (one fused copy)
=================================  =========================================

40 bytes in three vectorized passes, where the single-tensor loop moves ~100
and allocates temporaries.  A single pass that reads the bf16 gradient and
writes the bf16 weight itself (28 bytes, no FP32 gradient) is measured next to
these in ``benchmarks/bench_lightning_fused_step.py`` (a ``torch.compile``'d
update, and eager chunks through the same fused kernel).  Where nothing reads
the master gradients before the step, ``bf16-master`` on the CPU takes that
single pass, native and bit for bit these three (:mod:`lightning_ext.master_native`).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch
from torch.optim import Optimizer

__all__ = ["FUSABLE", "fusable_groups", "fused_implementation"]

FUSABLE = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.Adagrad)
"""Optimizer classes whose torch implementation has a fused kernel (exact classes only: a subclass may
override ``step``)."""


@functools.cache
def _fused_devices() -> tuple[str, ...]:
    """The device types torch has fused optimizer kernels for (asked once: torch's answer costs ~60 us a call)."""
    try:
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

        return tuple(_get_fused_kernels_supported_devices())
    except ImportError:  # pragma: no cover - older torch
        return ("cuda",)


def fusable_groups(optimizer: Optimizer) -> list[dict[str, Any]]:
    """The param groups of ``optimizer`` that :func:`fused_implementation` runs with the fused kernel."""
    if type(optimizer) not in FUSABLE:
        return []
    devices = _fused_devices()
    fast = ("cpu" in devices, "cuda" in devices)
    state = optimizer.state
    groups = []
    for group in optimizer.param_groups:
        if "fused" not in group or group.get("fused") is not None or group.get("foreach") is not None:
            continue  # the user chose an implementation (or this torch has no fused flag)
        if group.get("differentiable") or group.get("capturable"):
            continue
        params = [p for p in group["params"] if p.grad is not None]
        if params and all(_fusable(p, state.get(p), devices, fast) for p in params):
            groups.append(group)
    return groups


def _fusable(p: torch.Tensor, state: Any, devices: tuple[str, ...], fast: tuple[bool, bool]) -> bool:
    """Dense FP32 parameter and gradient on a fused device, its step count (if any) on that device.

    Every step asks this of every parameter: the cheap tensor properties first (``is_cpu``,
    ``layout``, ``get_device``: no ``torch.device`` object built per parameter).
    """
    grad = p.grad
    if p.dtype is not _F32 or grad.dtype is not _F32 or grad.layout is not torch.strided:
        return False
    if not ((fast[0] and p.is_cpu) or (fast[1] and p.is_cuda) or p.device.type in devices):
        return False
    step = state.get("step") if isinstance(state, dict) else None
    # the fused kernels keep the step count on the parameter's device (the loop keeps it on the CPU)
    return not isinstance(step, torch.Tensor) or (step.is_cpu == p.is_cpu and step.get_device() == p.get_device())


_F32 = torch.float32


@contextlib.contextmanager
def fused_implementation(optimizer: Optimizer) -> Iterator[bool]:
    """Around ``optimizer.step()``: the fused kernel for the groups of :func:`fusable_groups`; yields whether
    any group runs fused.  The groups' ``fused`` setting is restored afterwards, also when the step raises."""
    groups = fusable_groups(optimizer)
    for group in groups:
        group["fused"] = True
    try:
        yield bool(groups)
    finally:
        for group in groups:
            group["fused"] = None
