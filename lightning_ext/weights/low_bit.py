"""8-bit block-quantized Adam states in Lightning (``state_dtype="8bit"``): torchao's ``AdamW8bit`` computes the step.

torchao's ``AdamW8bit`` stores m and v by the core's rule (:mod:`mp_callbacks.weights`: the map, block size and
codes are tested bit for bit against it).  Under the knob the user's ``torch.optim.AdamW`` stays the user's
object; :class:`EightBitAdamW` builds an ``AdamW8bit`` over the same param groups (each group's ``lr`` becomes
a tensor, as torchao wants and torch's LR schedulers fill) and the same ``state`` dict, and steps the user's
optimizer with the 8-bit update as its closure: the user's step hooks and LR-scheduler bookkeeping run once,
the update is torchao's, and the spent gradients are released so the user's own loop updates nothing.  The
user's ``state_dict()`` therefore holds the 8-bit states, and loading one puts them back.  Any other optimizer,
``amsgrad``/``maximize``, or an AdamW that already holds state is a clear error.

Checkpoints (:func:`plain_state_checkpoints`, on the user's optimizer and on any torchao optimizer the plugin
sets up): torchao holds each quantized state as a tensor subclass, which ``torch.load`` cannot rebuild under
the Trainer's callable ``map_location``; the optimizer's ``state_dict()`` gives each one as plain data instead
(its tensors and attributes, :data:`RECORD_KEY`), and ``load_state_dict`` makes the subclass again from them,
so a checkpoint loads with ``weights_only=True`` and a resume continues bit for bit.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.optim import Optimizer

from mp_callbacks.weights import BLOCK_SIZE

__all__ = ["EightBitAdamW"]

RECORD_KEY = "torchao_state"
"""The key naming the torchao subclass of a quantized state saved as plain data (``{RECORD_KEY: class name,
"tensors": {name: tensor}, "attributes": [...]}``: its ``__tensor_flatten__``)."""


class EightBitAdamW:
    """torchao's ``AdamW8bit`` stepping a torch ``AdamW``'s param groups and state (see the module's rule).

    Args:
      optimizer: the user's ``torch.optim.AdamW`` (exact class), before its first step.

    Raises:
      ValueError: another optimizer, ``amsgrad`` or ``maximize``, or an optimizer that holds state already.
    """

    def __init__(self, optimizer: Optimizer) -> None:
        from torchao.optim import AdamW8bit

        if type(optimizer) is not torch.optim.AdamW:
            raise ValueError(f"state_dtype='8bit' block-quantizes AdamW's m and v with torchao's AdamW8bit: the "
                             f"optimizer must be torch.optim.AdamW (or torchao.optim.AdamW8bit), not "
                             f"{type(optimizer).__name__}")
        if any(g.get("amsgrad") or g.get("maximize") for g in optimizer.param_groups):
            raise ValueError("state_dtype='8bit': amsgrad and maximize are not offered (torchao's AdamW8bit)")
        if any(len(s) for s in optimizer.state.values()):
            raise ValueError("state_dtype='8bit': the AdamW already holds FP32 state; set the recipe up before the "
                             "first step (a checkpoint of FP32 states does not load into 8-bit ones)")
        d = optimizer.defaults
        self.optimizer = optimizer
        self.inner = AdamW8bit(optimizer.param_groups, lr=float(d["lr"]), betas=d["betas"], eps=d["eps"],
                               weight_decay=d["weight_decay"], block_size=BLOCK_SIZE)
        self._link(optimizer)
        plain_state_checkpoints(optimizer)
        optimizer.register_load_state_dict_post_hook(self._link)

    def _link(self, optimizer: Optimizer) -> None:
        """The 8-bit optimizer reads the user's groups and state (made again by every ``load_state_dict``)."""
        self.inner.param_groups = optimizer.param_groups
        self.inner.state = optimizer.state

    def update(self) -> None:
        """The 8-bit update of every parameter with a gradient; the spent gradients are released."""
        self.inner.step()
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                p.grad = None

    def step(self) -> Any:
        """``optimizer.step()`` with :meth:`update` as its closure (hooks and schedulers see one step)."""
        return self.optimizer.step(closure=self.update)


_HOOKED: weakref.WeakSet[Optimizer] = weakref.WeakSet()


def plain_state_checkpoints(opt: Optimizer) -> None:
    """Hook ``opt`` (once) so that its state dict holds torchao's quantized states as plain data and loading
    it makes them again (see the module)."""
    if opt in _HOOKED:
        return
    opt.register_state_dict_post_hook(_to_plain)
    opt.register_load_state_dict_pre_hook(_from_plain, prepend=True)  # before any hook that reads the states
    _HOOKED.add(opt)


def _is_subclass_state(v: Any) -> bool:
    return isinstance(v, torch.Tensor) and type(v).__module__.startswith("torchao.optim")


def _to_plain(optimizer: Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
    def record(v: Any) -> Any:
        if not _is_subclass_state(v):
            return v
        names, attributes = v.__tensor_flatten__()
        return {RECORD_KEY: type(v).__name__, "tensors": {n: getattr(v, n) for n in names},
                "attributes": list(attributes)}

    state = {i: {k: record(v) for k, v in s.items()} for i, s in state_dict["state"].items()}  # new dicts: the
    return {**state_dict, "state": state}  # per-parameter dicts of state_dict() are the optimizer's own


def _subclasses() -> dict[str, type]:
    from torchao.optim.subclass_4bit import OptimState4bit
    from torchao.optim.subclass_8bit import OptimState8bit
    from torchao.optim.subclass_fp8 import OptimStateFp8

    return {c.__name__: c for c in (OptimState8bit, OptimState4bit, OptimStateFp8)}


def _from_plain(optimizer: Optimizer, state_dict: dict[str, Any]) -> dict[str, Any] | None:
    def is_record(v: Any) -> bool:
        return isinstance(v, dict) and RECORD_KEY in v

    if not any(is_record(v) for s in state_dict["state"].values() for v in s.values()):
        return None
    classes = _subclasses()

    def rebuild(v: Any) -> Any:
        if not is_record(v):
            return v
        if v[RECORD_KEY] not in classes:
            raise ValueError(f"a checkpoint's optimizer state is a {v[RECORD_KEY]!r}; this torchao has "
                             f"{', '.join(classes)}")
        return classes[v[RECORD_KEY]].__tensor_unflatten__(dict(v["tensors"]), list(v["attributes"]), None, None)

    state = {i: {k: rebuild(v) for k, v in s.items()} for i, s in state_dict["state"].items()}
    return {**state_dict, "state": state}
