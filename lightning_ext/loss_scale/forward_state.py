"""What the forward pass writes, kept so that a skipped step writes nothing.

A skipped step must change nothing the model learns from (the design's skip semantics), but
some modules update state in the forward pass, before anyone knows the step will be skipped:
BatchNorm's running mean, variance and batch counter, or any buffer a custom module writes.
After one inf batch those statistics would be NaN and every later evaluation output NaN.

The rule: at the first training forward after an optimizer step (:meth:`ForwardState.begin`,
called as the forward context is entered), copy every buffer of the modules in training mode
into a kept copy (allocated once; a copy per buffer per step); when the optimizer step is skipped, copy them back
(:meth:`ForwardState.end`).  Gradient accumulation is covered: the copy is taken at the first
micro-batch.  ``restore_forward_state=False`` on the plugin turns it off.

Which modules own buffers is found by one walk of the model, kept until a module or buffer is
registered anywhere in the process (torch's global registration hooks count them; ``register_buffer``,
assigning a tensor to a buffer name and assigning a submodule all register), so a step reads the
buffers of the modules that own some, not every module of the tree.
"""

from __future__ import annotations

import weakref

import torch
from torch import Tensor, nn

__all__ = ["ForwardState"]

_registrations = [0]  # modules and buffers registered in this process since the hooks went in
_hooked = False


def _count(*_: object) -> None:
    _registrations[0] += 1


def _watch_registrations() -> None:
    """Count every module and buffer registration from now on (once per process)."""
    global _hooked
    if not _hooked:
        _hooked = True
        nn.modules.module.register_module_buffer_registration_hook(_count)
        nn.modules.module.register_module_module_registration_hook(_count)


class ForwardState:
    """The buffers of a step's training-mode modules as they were before its first forward."""

    def __init__(self) -> None:
        self._buffers: list[Tensor] = []
        self._kept: list[Tensor] = []
        self._armed = False
        self._owners: list[nn.Module] = []  # the modules of the tree that own buffers
        self._tree: tuple[weakref.ref, int] | None = None  # (root, registrations) the owners were found at
        _watch_registrations()

    def begin(self, root: nn.Module | None) -> None:
        """Keep the buffers of ``root``'s training-mode modules, unless this step already did."""
        if self._armed or root is None or not root.training:
            return
        if self._tree is None or self._tree[0]() is not root or self._tree[1] != _registrations[0]:
            self._owners = [m for m in root.modules() if next(m.buffers(recurse=False), None) is not None]
            self._tree = (weakref.ref(root), _registrations[0])
        if not self._owners and not self._buffers:  # nothing to keep (most transformers): no op, no grad mode
            self._armed = True
            return
        buffers: list[Tensor] = []
        for m in self._owners:  # a module's own buffers
            if m.training:
                buffers.extend(dict.fromkeys(m.buffers(recurse=False)))
        if len(buffers) != len(self._buffers) or any(a is not b for a, b in zip(buffers, self._buffers)):
            self._buffers = buffers
            self._kept = [torch.empty_like(b) for b in buffers]
        with torch.no_grad():
            for kept, b in zip(self._kept, self._buffers):
                kept.copy_(b)
        self._armed = True

    def end(self, skipped: bool) -> None:
        """The optimizer step is over: put the buffers back when it was skipped; the next forward keeps anew."""
        if self._armed and skipped and self._buffers:
            with torch.no_grad():
                for kept, b in zip(self._kept, self._buffers):
                    b.copy_(kept)
        self._armed = False
