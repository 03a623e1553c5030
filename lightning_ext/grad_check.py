"""The step's non-finite check over an optimizer's gradients (the twin of :mod:`keras_ext.grad_check`).

Rule: one pass over every gradient the optimizer will read, setting ``found_inf`` to 1 when any value is inf
or NaN. With loss scaling on it is torch's fused ``_amp_foreach_non_finite_check_and_unscale_``, which also
multiplies each value by ``inv_scale`` in place (all gradients in one call on CPU, whose kernel takes mixed
dtypes; one call per device and dtype elsewhere, as ``GradScaler``). With scaling off nothing is written: on
the CPU, dense contiguous bf16/FP32 gradients are scanned read-only (half the kernel's memory traffic, and
the gradients come out of it in cache for the optimizer step that reads them next, measured in
``benchmarks/README.md``) by one native call over the optimizer's groups (:mod:`lightning_ext.check_native`),
or, where that is not available or declines, by :func:`any_nonfinite` (:mod:`lightning_ext.master_native`'s
scan, the gradients listed in Python), last parameter first, so that the first ones, which the optimizer
reads first, are the latest read; where the scan does not
apply (another device or dtype, a sparse or strided gradient, no native library, more intra-op threads) the
fused kernel runs with the unit inverse scale, which leaves the values as they are. What the check reads of a
gradient: a DTensor's (FSDP2 shard's) local shard, a sparse gradient's values (a float16 one coalesced first,
as ``GradScaler``). When the flag decides a skip (``reduce``), it is all-reduced (MAX) over the process group,
so every rank decides alike.
"""

from __future__ import annotations

from operator import attrgetter
from typing import Any

import torch
from torch import Tensor

from .check_native import native_check
from .master_native import native_adam

__all__ = ["Flags", "UnitScales", "any_nonfinite", "dense_local", "host_check", "non_finite_check"]

_STRIDED, _F32, _BF16 = torch.strided, torch.float32, torch.bfloat16
_SCANNED = {_F32, _BF16}
_dtype, _layout, _is_cpu = attrgetter("dtype"), attrgetter("layout"), attrgetter("is_cpu")


def dense_local(p: Tensor) -> Tensor:
    """What the check reads of ``p.grad`` (see the module's rule)."""
    grad = p.grad
    if type(grad) is not Tensor and hasattr(grad, "device_mesh"):
        grad = grad.to_local()
    if grad.is_sparse:
        if grad.dtype is torch.float16:
            p.grad = grad = grad.coalesce()
        grad = grad._values()
    return grad


def any_nonfinite(grads: list[Tensor]) -> bool | None:
    """Whether a value of ``grads`` is inf or NaN, by the native scan (read only); None where it does not apply
    (not loaded, or a gradient that is not a dense contiguous bf16/FP32 CPU tensor).  Runs after every backward,
    where the gradients' tensor objects are cold in the cache: each property is read over the whole list at once
    (``map``, no Python loop)."""
    native = native_adam()
    if native is None:
        return None
    dtypes = list(map(_dtype, grads))
    if not (_SCANNED.issuperset(dtypes) and set(map(type, grads)) <= {Tensor} and set(map(_layout, grads)) <= {_STRIDED}
            and all(map(_is_cpu, grads)) and all(map(Tensor.is_contiguous, grads))):
        return None
    return native.scan(grads, [d is _F32 for d in dtypes])


def host_check(optimizer: Any, device: torch.device, reduce: bool) -> bool | None:
    """The check of a step without loss scaling decided on the host, no tensor made: whether ``optimizer``'s
    gradients hold an inf or NaN, by :func:`any_nonfinite`.  None where :func:`non_finite_check` must decide: a
    device other than the CPU, gradients the scan does not take, or ``reduce`` inside a process group of more
    than one process (the ranks agree through the all-reduce of its flag)."""
    if device.type != "cpu" or (reduce and _in_group()):
        return None
    return _scan(optimizer)


def _scan(optimizer: Any) -> bool | None:
    """Whether ``optimizer``'s gradients hold an inf or NaN, by one native call
    (:func:`~lightning_ext.check_native.native_check`) or else :func:`any_nonfinite`; None where neither
    applies."""
    native = native_check()
    if native is not None:
        found = native.groups(_param_groups(optimizer))
        if found >= 0:
            return found == 1
    return any_nonfinite(_grads(optimizer)[::-1])  # the order: the module's rule


class UnitScales:
    """The inverse scale 1 per device (scaling off), made once each."""

    def __init__(self) -> None:
        self._units: dict[torch.device, Tensor] = {}

    def on(self, device: torch.device) -> Tensor:
        """The 0-d float32 one on ``device``."""
        unit = self._units.get(device)
        if unit is None:
            unit = self._units[device] = torch.ones((), dtype=torch.float32, device=device)
        return unit


class Flags:
    """``found_inf`` values decided on the host: a 0-d float32 0 or 1 per device, made once each and made again
    when something wrote to one (its version moved), so a caller that changes the flag it got changes no other."""

    def __init__(self) -> None:
        self._made: dict[tuple[bool, torch.device], tuple[Tensor, int]] = {}

    def of(self, overflow: bool, device: torch.device) -> Tensor:
        """The flag of ``overflow`` on ``device``."""
        made = self._made.get((overflow, device))
        if made is None or made[0]._version != made[1]:
            flag = torch.full((), float(overflow), dtype=torch.float32, device=device)
            made = self._made[(overflow, device)] = (flag, flag._version)
        return made[0]


def non_finite_check(optimizer: Any, device: torch.device, inv_scale: Tensor | None, units: UnitScales,
                     reduce: bool) -> Tensor:
    """Check (and unscale by ``inv_scale``; None: scaling off, nothing written) ``optimizer``'s gradients;
    returns ``found_inf``, a 0-d float32 tensor on ``device``.  ``reduce``: all-reduce it over the process group.

    Runs after every backward: the common case (dense CPU gradients, one process) is one comprehension,
    one look at each gradient and one native or kernel call; everything else takes the general grouping."""
    if inv_scale is None and device.type == "cpu":
        found = _scan(optimizer)  # None: the scan does not apply
        if found is not None:
            return _reduced(torch.full((), float(found), dtype=torch.float32, device=device), reduce)
    grads = _grads(optimizer)
    dense_cpu = all(type(g) is Tensor and g.layout is _STRIDED and g.is_cpu for g in grads)
    found_inf = torch.zeros((), dtype=torch.float32, device=device)
    if dense_cpu and device.type == "cpu":
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale if inv_scale is not None
                                                         else units.on(device))
    else:
        _check_grouped(_param_groups(optimizer), device, inv_scale, units, found_inf)
    return _reduced(found_inf, reduce)


def _param_groups(optimizer: Any) -> Any:
    """``optimizer.param_groups`` (a test double without them: no groups, no gradients)."""
    param_groups = getattr(optimizer, "param_groups", None)
    return param_groups if isinstance(param_groups, (list, tuple)) else ()


def _grads(optimizer: Any) -> list[Tensor]:
    """Every gradient of ``optimizer``'s parameters that is not None, in the groups' order."""
    return [g for group in _param_groups(optimizer) for p in group["params"] if (g := p.grad) is not None]


def _in_group() -> bool:
    """Whether this process is in a process group of more than one process."""
    dist = torch.distributed
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _check_grouped(param_groups: Any, device: torch.device, inv_scale: Tensor | None, units: UnitScales,
                   found_inf: Tensor) -> None:
    """The check by device and dtype (one kernel call each, as ``GradScaler``), shards and sparse gradients
    read as :func:`dense_local` says; every group's flag summed into ``found_inf``."""
    grads = [dense_local(p) for group in param_groups for p in group["params"] if p.grad is not None]
    groups: dict[tuple[torch.device, torch.dtype | None], list[Tensor]] = {}
    if device.type == "cpu" and all(g.device == device for g in grads):
        groups[(device, None)] = grads  # the CPU kernel takes mixed dtypes
    else:
        for g in grads:
            groups.setdefault((g.device, g.dtype), []).append(g)
    for (dev, _), group_grads in groups.items():
        local = found_inf if dev == device else torch.zeros((), dtype=torch.float32, device=dev)
        torch._amp_foreach_non_finite_check_and_unscale_(
            group_grads, local, inv_scale.to(dev) if inv_scale is not None else units.on(dev))
        if local is not found_inf:
            found_inf.add_(local.to(device))


def _reduced(found_inf: Tensor, reduce: bool) -> Tensor:
    """``found_inf``, all-reduced (MAX) over the process group when ``reduce`` (inside a group of more than one
    process)."""
    if reduce and _in_group():
        torch.distributed.all_reduce(found_inf, op=torch.distributed.ReduceOp.MAX)
    return found_inf
