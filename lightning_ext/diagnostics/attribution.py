"""Overflow attribution in torch: which module first produced an inf/NaN.

:class:`OverflowTracer` hooks every sub-module and queues device flags
(no host sync) as the step runs; :func:`blame` reads them once on an overflow
step and applies the core's blame order
(:func:`~mp_callbacks.diagnostics.first_culprit`: forward outputs in call
order, then the loss, then gradients in backward order).  Under DDP the ranks
agree on one answer.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor, nn

from mp_callbacks.diagnostics import LOSS_SOURCE, first_culprit

from ..support import tensors_in

__all__ = ["OverflowTracer", "blame"]


class OverflowTracer:
    """Device-side "became non-finite" flags per module, in the order they happened (no host sync).

    While :attr:`active`, every hooked module appends ``(kind, path, flag)``
    records: a ``"forward"`` record after its forward (any floating output
    non-finite), ``"backward"`` records when the gradient of its inputs is
    computed (the gradient its backward produced) and when the gradient of its
    own parameters is computed.  :meth:`on_loss` adds a ``"loss"`` record.
    :meth:`first_bad` reads the flags (one sync) and hands the non-finite
    forward records (call order), the loss flag and the non-finite backward
    records (the order they fired: backward order) to the core's
    :func:`~mp_callbacks.diagnostics.first_culprit`.  The root module is
    not hooked (its forward is the whole model); when several modules receive
    the same input tensor the innermost (last to register) owns its gradient record.
    """

    def __init__(self) -> None:
        self.active = False
        self.records: list[tuple[str, str, Tensor]] = []
        self._handles: list[Any] = []
        self._inputs: dict[int, tuple[Any, list[str]]] = {}

    def install(self, root: nn.Module) -> None:
        """Hook every sub-module of ``root`` (and its directly owned parameters)."""
        self.remove()
        seen: set[int] = set()
        for path, module in root.named_modules():
            if module is root or not path:
                continue
            self._handles.append(module.register_forward_pre_hook(self._pre_hook(path), with_kwargs=True))
            self._handles.append(module.register_forward_hook(self._post_hook(path), always_call=False))
            for param in module.parameters(recurse=False):
                if param.requires_grad and id(param) not in seen:
                    seen.add(id(param))
                    self._handles.append(param.register_hook(self._grad_hook([path])))

    def remove(self) -> None:
        """Take every hook off and forget the records."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self.records.clear()
        self._inputs.clear()

    @staticmethod
    def _bad(tensors: Iterator[Tensor]) -> Tensor | None:
        flag = None
        with torch.no_grad():
            for t in tensors:
                if t.is_floating_point() and t.numel():
                    # One read pass: an inf/NaN element makes the float32 sum non-finite (a
                    # sum of finite fp16/bf16 values cannot overflow float32 in practice);
                    # cheaper than isfinite(t).all(), which materialises a bool tensor.
                    b = torch.logical_not(torch.isfinite(t.detach().sum(dtype=torch.float32)))
                    flag = b if flag is None else torch.logical_or(flag, b.to(flag.device))
        return flag

    def _grad_hook(self, owner: list[str]) -> Callable[[Tensor], None]:
        def hook(grad: Tensor) -> None:
            if self.active:
                flag = self._bad(iter((grad,)))
                if flag is not None:
                    self.records.append(("backward", owner[0], flag))
        return hook

    def _pre_hook(self, path: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            if not self.active or not torch.is_grad_enabled():
                return None
            for t in tensors_in((args, kwargs)):
                if not (t.requires_grad and t.is_floating_point()):
                    continue
                known = self._inputs.get(id(t))
                if known is not None and known[0]() is t:
                    known[1][0] = path  # the innermost module receiving this tensor owns its gradient
                    continue
                owner = [path]
                try:
                    t.register_hook(self._grad_hook(owner))
                except RuntimeError:
                    continue
                self._inputs[id(t)] = (weakref.ref(t), owner)
            return None
        return hook

    def _post_hook(self, path: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            if self.active:
                flag = self._bad(tensors_in(output))
                if flag is not None:
                    self.records.append(("forward", path, flag))
            return None
        return hook

    def on_loss(self, loss: Tensor) -> None:
        """Record whether the (scaled) loss about to be back-propagated is non-finite."""
        if self.active:
            flag = self._bad(iter((loss,)))
            if flag is not None:
                self.records.append(("loss", LOSS_SOURCE, flag))

    def take(self, count: int | None = None) -> list[tuple[str, str, Tensor]]:
        """Remove and return the first ``count`` records (all when None)."""
        count = len(self.records) if count is None else count
        taken, self.records = self.records[:count], self.records[count:]
        if not self.records:
            self._inputs.clear()
        return taken

    @staticmethod
    def first_bad(records: list[tuple[str, str, Tensor]]) -> str | None:
        """The core's :func:`~mp_callbacks.diagnostics.first_culprit` of ``records``
        (reads the flags: one sync), None if all are finite."""
        if not records:
            return None
        device = records[0][2].device
        flags = torch.stack([f.to(device) for _, _, f in records]).tolist()
        bad = [(kind, path) for (kind, path, _), b in zip(records, flags) if b]
        return first_culprit([p for k, p in bad if k == "forward"], any(k == "loss" for k, _ in bad),
                             [p for k, p in bad if k == "backward"])


def blame(records: list[tuple[str, str, Tensor]]) -> str | None:
    """The first non-finite record; under DDP every rank takes the same answer.

    Each rank finds its local culprit (its own forward outputs and local
    gradients, before DDP's all-reduce spreads the NaN), then the ranks
    exchange them (``all_gather_object``; every rank gets here on the same
    steps, since the overflow flag is all-reduced by the scaler) and all take
    the answer of the lowest rank that found one.  So every rank blames, and
    moves to FP32, the same module.
    """
    local = OverflowTracer.first_bad(records)
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return local
    gathered: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    return next((g for g in gathered if g), None)
