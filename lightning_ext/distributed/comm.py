"""Gradient communication precision under DDP: the recipe's ``comm_dtype`` as a DDP communication hook.

The core decides the dtype (:attr:`mp_callbacks.recipes.Recipe.comm_dtype`);
this module registers the hook that reduces in it:

* ``float16`` / ``bfloat16``: torch's own ``fp16_compress_hook`` /
  ``bf16_compress_hook`` (``torch.distributed.algorithms.ddp_comm_hooks.default_hooks``):
  each bucket is cast, divided by the world size, all-reduced and copied back
  (DDP accepts torch's bf16 hook with NCCL/XCCL only; elsewhere, gloo on CPU,
  :func:`cast_hook` does the same steps);
* ``float32`` with FP32 gradients: no hook (DDP's own all-reduce); with
  low-precision gradients (``*-master`` keeps bf16/fp16 parameters, so DDP's
  buckets are bf16/fp16) the buckets are cast up to FP32 for the reduction
  (torch ships no such hook; :func:`cast_hook` is the same recipe as torch's).

The reduction happens inside the backward, before the plugin unscales and
checks the gradients, so under loss scaling an fp16 reduction that overflows
(a finite FP32 gradient above 65504 x world size) is an inf the overflow
check sees after the reduction: every rank skips that step and the scale
backs off.

:class:`CommCounter` with :func:`cast_hook` counts what is handed to
``all_reduce`` (the bytes of the cast bucket, per bucket), for measurements:
``plugin.comm_counter = CommCounter()`` before ``fit`` makes the plugin
register the counting form (numerically the same as torch's hooks).

Under Fabric the plugin is shown no DDP wrapper: :class:`DDPWatch` (torch's global module-registration hook)
notes the ``DistributedDataParallel`` that adopts the model during ``fabric.setup``, and the plugin registers
the hook on it before the first forward.

Under FSDP2 (``ModelParallelStrategy``, ``fully_shard``) the precision of
gradient communication is the ``MixedPrecisionPolicy``'s ``reduce_dtype``
(:func:`lightning_ext.distributed.fsdp.fsdp_policy`); there is no hook to register.  The
same ``plugin.comm_counter`` counts there too: :func:`count_fsdp_collectives`
gives every unit a counting reduce-scatter and all-gather through FSDP2's public
``set_custom_reduce_scatter`` / ``set_custom_all_gather``, each the collective FSDP2 runs by default
(``torch.distributed``'s single-tensor all-gather and reduce-scatter) after counting the call's whole
(unsharded) buffer; :func:`fsdp_comm_units` reads the units for the core's estimate
(:func:`mp_callbacks.memory.fsdp_step_bytes`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException

from mp_callbacks.dtypes import canonical_dtype

from ..fp8 import FP8AllGatherWeight

__all__ = ["CommCounter", "DDPWatch", "cast_hook", "comm_hook", "count_fsdp_collectives", "fsdp_comm_units",
           "register_comm_hook"]

_TORCH = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class CommCounter:
    """Bytes handed to collectives: ``total_bytes``, ``calls``, ``by_dtype`` and ``by_op`` (op -> dtype -> bytes).

    A call counts its whole buffer: the bucket of a DDP ``all_reduce``, the
    unsharded gradients of an FSDP2 ``reduce_scatter`` (its input), the
    unsharded parameters of an FSDP2 ``all_gather`` (its output).
    """

    def __init__(self) -> None:
        self.total_bytes = 0
        self.calls = 0
        self.by_dtype: dict[str, int] = {}
        self.by_op: dict[str, dict[str, int]] = {}

    def add(self, tensor: torch.Tensor, op: str = "all_reduce") -> None:
        """Count one collective's buffer."""
        size = tensor.numel() * tensor.element_size()
        name = str(tensor.dtype).replace("torch.", "")
        self.total_bytes += size
        self.calls += 1
        self.by_dtype[name] = self.by_dtype.get(name, 0) + size
        per_op = self.by_op.setdefault(op, {})
        per_op[name] = per_op.get(name, 0) + size

    def reset(self) -> None:
        """Start counting from zero."""
        self.__init__()

    def __repr__(self) -> str:
        return (f"CommCounter(total_bytes={self.total_bytes}, calls={self.calls}, by_dtype={self.by_dtype}, "
                f"by_op={self.by_op})")


def cast_hook(comm_dtype: str, counter: CommCounter | None = None) -> Callable[[Any, Any], Any]:
    """A DDP hook that all-reduces each bucket in ``comm_dtype`` (mean over ranks), counting into ``counter``.

    The same steps as torch's ``_compress_hook``: cast the bucket (a no-op when
    it already is ``comm_dtype``), divide by the world size, all-reduce, copy the
    result back into the bucket.  Any bucket dtype works (FP32 buckets reduced
    in bf16, bf16 buckets reduced in FP32).
    """
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    dtype = _TORCH[canonical_dtype(comm_dtype, "comm_dtype")]

    def hook(state, bucket):  # no annotations: DDP checks them (and this module's are strings)
        buffer = bucket.buffer()
        wire = buffer.to(dtype)
        if counter is not None:
            counter.add(wire)
        if wire is buffer:
            return allreduce_hook(state, bucket)
        bucket.set_buffer(wire)  # allreduce_hook divides and reduces the bucket's buffer
        fut = allreduce_hook(state, bucket)

        def back(done: Any) -> torch.Tensor:
            buffer.copy_(done.value())
            return buffer

        return fut.then(back)

    return hook


def comm_hook(comm_dtype: str, grad_dtypes: set, counter: CommCounter | None = None) -> Callable | None:
    """The hook that reduces gradients of ``grad_dtypes`` in ``comm_dtype`` (None: DDP's own all-reduce)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    comm = canonical_dtype(comm_dtype, "comm_dtype")
    if counter is not None:
        return cast_hook(comm, counter)
    if comm == "float16":
        return default_hooks.fp16_compress_hook
    if comm == "bfloat16":
        return default_hooks.bf16_compress_hook
    if all(d == torch.float32 for d in grad_dtypes):
        return None
    return cast_hook(comm)


def register_comm_hook(model: Any, comm_dtype: str, counter: CommCounter | None = None) -> Callable | None:
    """Register the hook of ``comm_dtype`` on a ``DistributedDataParallel`` ``model``; returns it (None: none needed).

    Models that are not DDP-wrapped are left alone (with a ``counter``, the
    FSDP2 units in them count their collectives: :func:`count_fsdp_collectives`).  A hook registered already
    (``DDPStrategy(ddp_comm_hook=...)``) and a ``comm_dtype`` that needs one
    are a ``MisconfigurationException``: DDP takes one hook.
    """
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(model, DistributedDataParallel):
        if counter is not None:
            count_fsdp_collectives(model, counter)
        return None
    dtypes = {p.dtype for p in model.parameters() if p.requires_grad}
    hook = comm_hook(comm_dtype, dtypes, counter)
    if hook is None:
        return None
    try:
        try:
            model.register_comm_hook(None, hook)
        except TypeError:  # DDP takes torch's bf16 hook with NCCL/XCCL only (by its name): the same steps, ours
            hook = cast_hook(comm_dtype, counter)
            model.register_comm_hook(None, hook)
    except RuntimeError as exc:
        raise MisconfigurationException(
            f"lightning_ext.MixedPrecision(comm_dtype={comm_dtype!r}) registers a DDP communication hook, but the "
            f"model has one already (DDPStrategy(ddp_comm_hook=...)); DDP takes one. Drop one of them "
            f"({exc})") from None
    return hook


class DDPWatch:
    """The ``DistributedDataParallel`` that adopts ``module`` from now on (:attr:`wrapper`, None until one does).

    torch's global module-registration hook (``register_module_module_registration_hook``) sees DDP's
    constructor register ``module`` as its child; the hook is removed once it has seen it, or by :meth:`remove`.
    """

    def __init__(self, module: torch.nn.Module) -> None:
        import weakref

        self.wrapper: Any = None
        self._module = weakref.ref(module)
        self._handle: Any = torch.nn.modules.module.register_module_module_registration_hook(self._seen)

    def _seen(self, parent: torch.nn.Module, name: str, child: torch.nn.Module) -> None:
        from torch.nn.parallel import DistributedDataParallel

        if self._module is not None and child is self._module() and isinstance(parent, DistributedDataParallel):
            self.wrapper = parent
            self.remove()

    def remove(self) -> None:
        """Stop watching (idempotent)."""
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def __getstate__(self) -> dict[str, Any]:  # a pickled plugin (a spawned process) watches nothing
        return {"wrapper": None, "_module": None, "_handle": None}


# ---------------------------------------------------------------------- FSDP2
class _CountingAllGather:
    """FSDP2's all-gather (``all_gather_into_tensor`` into a new buffer) that counts each call's output first."""

    def __init__(self, counter: CommCounter) -> None:
        self.counter = counter

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any,
                 async_op: bool = False) -> Any:
        self.counter.add(output_tensor, "all_gather")
        dist = torch.distributed
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # the name by torch version
        return gather(output_tensor, input_tensor, group=group, async_op=async_op)


class _CountingReduceScatter:
    """FSDP2's reduce-scatter (``reduce_scatter_tensor``) that counts each call's input first."""

    def __init__(self, counter: CommCounter) -> None:
        self.counter = counter

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any,
                 async_op: bool = False) -> Any:
        self.counter.add(input_tensor, "reduce_scatter")
        dist = torch.distributed
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor  # by torch version
        return scatter(output_tensor, input_tensor, op=op, group=group, async_op=async_op)


def count_fsdp_collectives(module: torch.nn.Module, counter: CommCounter) -> int:
    """Count every FSDP2 unit's reduce-scatters and all-gathers in ``module`` into ``counter``; returns the units.

    Each unit gets the counting collectives through FSDP2's ``set_custom_all_gather`` /
    ``set_custom_reduce_scatter`` (a custom collective of the user's on a unit is replaced); they run the same
    collectives as FSDP2's defaults, so training is bit-for-bit what it is without counting.
    """
    from torch.distributed.fsdp import FSDPModule

    units = 0
    for sub in module.modules():
        if isinstance(sub, FSDPModule):
            sub.set_custom_all_gather(_CountingAllGather(counter))
            sub.set_custom_reduce_scatter(_CountingReduceScatter(counter))
            units += 1
    return units


def _gather_name(fsdp_param: Any, gather: str) -> str:
    """A parameter's gather dtype: ``float8_e4m3fn`` for a weight FSDP2 gathers in FP8 (its first gather decided)."""
    local = fsdp_param.sharded_param._local_tensor
    return "float8_e4m3fn" if isinstance(local, FP8AllGatherWeight) and local._link.gathered_fp8 else gather


def fsdp_comm_units(module: torch.nn.Module) -> tuple[list[tuple[list[tuple[int, ...]], str, str, int]], int]:
    """``module``'s FSDP2 units as :func:`mp_callbacks.memory.fsdp_step_bytes` takes them, and the shard count.

    Per unit: its parameters' unsharded shapes, the gather dtype (the policy's ``param_dtype``, else the
    parameters'; one per parameter when a weight gathers in FP8: ``float8_e4m3fn``), the reduce dtype
    (``reduce_dtype``, else the gather dtype) and the gathers per step (2 when the unit reshards after
    forward, as FSDP2 decides for non-root units; 1 otherwise).
    Read after the first step (FSDP2 settles the root's resharding at its lazy init).
    """
    from torch.distributed.fsdp import FSDPModule

    from mp_callbacks.dtypes import canonical_dtype as name

    units, world = [], 1
    for sub in module.modules():
        if not isinstance(sub, FSDPModule):
            continue
        group = sub._get_fsdp_state()._fsdp_param_group
        if group is None or not group.fsdp_params:
            continue
        policy = group.mp_policy
        gather = name(policy.param_dtype or group.fsdp_params[0].sharded_param.dtype)
        reduce = name(policy.reduce_dtype or gather)
        gathers = 2 if group.post_forward_mesh_info is not None else 1
        per_param = [_gather_name(fp, gather) for fp in group.fsdp_params]
        units.append(([tuple(fp._orig_size) for fp in group.fsdp_params],
                      gather if len(set(per_param)) == 1 and per_param[0] == gather else per_param, reduce, gathers))
        world = max(world, group.mesh_info.shard_mesh_size)
    return units, world
