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
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from mp_callbacks.dtypes import canonical_dtype

__all__ = ["CommCounter", "cast_hook", "comm_hook", "register_comm_hook"]

_TORCH = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class CommCounter:
    """Bytes handed to ``all_reduce`` by the gradient hook: ``total_bytes``, ``calls``, ``by_dtype``."""

    def __init__(self) -> None:
        self.total_bytes = 0
        self.calls = 0
        self.by_dtype: dict[str, int] = {}

    def add(self, tensor: torch.Tensor) -> None:
        """Count one collective's input tensor."""
        self.total_bytes += tensor.numel() * tensor.element_size()
        self.calls += 1
        name = str(tensor.dtype).replace("torch.", "")
        self.by_dtype[name] = self.by_dtype.get(name, 0) + tensor.numel() * tensor.element_size()

    def reset(self) -> None:
        """Start counting from zero."""
        self.__init__()

    def __repr__(self) -> str:
        return f"CommCounter(total_bytes={self.total_bytes}, calls={self.calls}, by_dtype={self.by_dtype})"


def cast_hook(comm_dtype: str, counter: Optional[CommCounter] = None) -> Callable[[Any, Any], Any]:
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


def comm_hook(comm_dtype: str, grad_dtypes: set, counter: Optional[CommCounter] = None) -> Optional[Callable]:
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


def register_comm_hook(model: Any, comm_dtype: str, counter: Optional[CommCounter] = None) -> Optional[Callable]:
    """Register the hook of ``comm_dtype`` on a ``DistributedDataParallel`` ``model``; returns it (None: none needed).

    Models that are not DDP-wrapped are left alone.  A hook registered already
    (``DDPStrategy(ddp_comm_hook=...)``) and a ``comm_dtype`` that needs one
    are a ``MisconfigurationException``: DDP takes one hook.
    """
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(model, DistributedDataParallel):
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
