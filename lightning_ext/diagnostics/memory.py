"""What a Lightning module and its optimizers hold under :class:`lightning_ext.MixedPrecision`, and the estimate.

The same report as the Keras adapter's: the bytes are counted from the
tensors that exist (real ``nbytes``); the estimate and the report's layout are
the core's :func:`mp_callbacks.memory.memory_report`.  The monitor
(:class:`lightning_ext.MixedPrecisionMonitor`) logs it at train start and end
and reads :func:`storage_dtypes` for its swamping meter.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from torch import Tensor, nn

from mp_callbacks.diagnostics import swamp_storage_dtype
from mp_callbacks.dtypes import canonical_dtype
from mp_callbacks.fp8 import fp8_state_bytes
from mp_callbacks.memory import MemoryEstimate, is_optimizer_state
from mp_callbacks.memory import memory_report as core_memory_report

from ..fabric import MixedPrecision
from ..loss_scale import unwrap_optimizer
from ..support import tensors_in

__all__ = ["held_tensors", "memory_report", "optimizer_params", "storage_dtypes"]


def held_tensors(t: Tensor) -> list[Tensor]:
    """The plain tensors that hold ``t``'s data: ``t`` itself, or a tensor subclass's inner tensors (torchao's
    quantized optimizer states: codes, scales, lookup table), so that bytes are counted as they are stored."""
    flatten = getattr(t, "__tensor_flatten__", None)
    if type(t) in (Tensor, nn.Parameter) or flatten is None:
        return [t]
    names, _ = flatten()
    return [inner for name in names for inner in held_tensors(getattr(t, name))]


def optimizer_params(optimizer: Any) -> list[Tensor]:
    """The parameters an optimizer updates (Lightning's wrapper unwrapped), in param-group order."""
    return [p for g in unwrap_optimizer(optimizer).param_groups for p in g["params"]]


def storage_dtypes(plugin: MixedPrecision, module: nn.Module,
                   optimizers: Iterable[Any]) -> dict[int, tuple[str, str]]:
    """``id(optimizer param) -> (stored dtype, swamping dtype)`` of every optimizer parameter.

    The stored dtype is the low-precision weight's (the FP32 master's low twin
    under ``*-master``, the gathered dtype under FSDP2); the swamping dtype is
    the core's :func:`~mp_callbacks.diagnostics.swamp_storage_dtype`.
    """
    kept: dict[int, bool] = {}
    for path, sub in module.named_modules():
        k = plugin.policy.keeps_fp32(sub, path)
        for p in sub.parameters(recurse=False):
            kept.setdefault(id(p), k)
    low_of = {id(e.master): e.low for e in plugin.masters.entries()} if plugin.masters is not None else {}
    gathered = plugin.sharded.gather_dtypes if plugin.sharded else {}
    out: dict[int, tuple[str, str]] = {}
    for opt in optimizers:
        for p in optimizer_params(opt):
            low = low_of.get(id(p), p)
            stored = canonical_dtype(gathered.get(id(p), low.dtype))
            out[id(p)] = (stored, swamp_storage_dtype(plugin.recipe, stored, kept.get(id(low), False)))
    return out


def memory_report(plugin: MixedPrecision, module: nn.Module, optimizers: Sequence[Any]) -> dict[str, Any]:
    """Bytes of model state actually held, next to the core's estimate (plain data).

    ``actual`` sums real tensor ``nbytes``: ``weights`` (the module's
    parameters), ``grads`` (their ``.grad`` plus the FP32 masters'),
    ``masters`` (optimizer parameters that are not module parameters: the
    FP32 masters of ``*-master``), ``optimizer_state`` (optimizer state
    tensors per :func:`mp_callbacks.memory.is_optimizer_state`).  The
    report is the core's :func:`mp_callbacks.memory.memory_report` (the
    estimate at the optimizer step, with ``weights_released`` as the
    plugin's ``free_weights_during_step``).  Gradients and optimizer state
    that do not exist yet (before the first step) are not counted in ``actual``.
    Under FSDP2 it is this rank's shards (:meth:`lightning_ext.distributed.fsdp.ShardedLayout.memory_report`).
    """
    if plugin.sharded is not None:  # FSDP2: this rank's shards, estimate with n_shards
        return plugin.sharded.memory_report(plugin.recipe, module, optimizers)
    params = list({id(p): p for p in module.parameters()}.values())
    own = {id(p) for p in params}
    grads = sum(p.grad.nbytes for p in params if p.grad is not None)
    masters = state = 0
    storage = storage_dtypes(plugin, module, optimizers)
    rows = []
    for opt in optimizers:
        raw = unwrap_optimizer(opt)
        for p in optimizer_params(raw):
            if id(p) not in own:
                masters += plugin.masters.held_nbytes(p) if plugin.masters is not None else p.nbytes
                grads += p.grad.nbytes if p.grad is not None else 0
        for slot in raw.state.values():
            state += sum(h.nbytes for v in tensors_in(slot) if is_optimizer_state(v.shape) for h in held_tensors(v))
        momentum = max((float(g.get("momentum", 0) or 0) for g in raw.param_groups), default=0.0)
        rows.append((type(raw).__name__, momentum, [(p.numel(), storage[id(p)][0]) for p in optimizer_params(raw)]))
    comp = sum(c.nbytes for c in plugin.rounding.buffers()) if plugin.rounding is not None else 0
    fp8 = plugin.fp8
    actual = MemoryEstimate(params=sum(p.numel() for p in params), weights=sum(p.nbytes for p in params),
                            grads=grads, masters=masters, optimizer_state=state, compensation=comp,
                            fp8_state=fp8.nbytes if fp8 is not None else 0)
    return core_memory_report(plugin.recipe.name, plugin.recipe.master, rows, actual,
                              weights_released=plugin.free_weights_during_step,
                              fp8_state=fp8_state_bytes(fp8.recipe, len(fp8.names)) if fp8 is not None else 0)
