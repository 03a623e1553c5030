"""8-bit block-quantized Adam states in Lightning (``state_dtype="8bit"``): torchao's ``AdamW8bit`` as the step.

torchao's ``AdamW8bit`` stores m and v by the core's rule (:mod:`mp_callbacks.weights.low_bit`: the map,
block size and codes are tested bit for bit against it), so under the knob the user's ``torch.optim.AdamW``
becomes one, in place (:func:`eight_bit_inner`: the same object, parameter groups and hyperparameters; each
group's ``lr`` a tensor, as torchao wants and torch's LR schedulers fill).  Any other optimizer, ``amsgrad``,
or an AdamW that already holds state is a clear error.  An LR scheduler made before the swap (the Trainer's
``configure_optimizers``) wrapped the instance's ``step`` around ``AdamW.step``: that wrapper is made again
around ``AdamW8bit.step``, so the scheduler still sees each step and the step is torchao's.

Checkpoints (:func:`plain_state_checkpoints`, on every torchao optimizer the plugin sets up): torchao holds
each quantized state as a tensor subclass, which ``torch.load`` cannot rebuild under the Trainer's callable
``map_location``; the optimizer's ``state_dict()`` gives each one as plain data instead (its tensors and
attributes, :data:`RECORD_KEY`), and ``load_state_dict`` makes the subclass again from them, so a
checkpoint loads with ``weights_only=True`` and a resume continues bit for bit.
"""

from __future__ import annotations

import weakref
from functools import wraps
from typing import Any

import torch
from torch.optim import Optimizer

from mp_callbacks.weights import BLOCK_SIZE, MasterPlan

__all__ = ["RECORD_KEY", "eight_bit_inner", "plain_state_checkpoints"]

RECORD_KEY = "torchao_state"
"""The key naming the torchao subclass of a quantized state saved as plain data (``{RECORD_KEY: class name,
"tensors": {name: tensor}, "attributes": [...]}``: its ``__tensor_flatten__``)."""


def eight_bit_inner(opt: Optimizer, plan: MasterPlan) -> Optimizer:
    """``opt``, turned into torchao's ``AdamW8bit`` in place when ``plan`` quantizes states (see the module);
    a torchao optimizer gets :func:`plain_state_checkpoints`."""
    if plan.quantized_states:
        opt = _to_adamw8bit(opt)
    if type(opt).__module__.startswith("torchao.optim"):
        plain_state_checkpoints(opt)
    return opt


def _to_adamw8bit(opt: Optimizer) -> Optimizer:
    from torchao.optim import AdamW8bit

    if isinstance(opt, AdamW8bit):
        return opt
    if type(opt) is not torch.optim.AdamW:
        raise ValueError(f"state_dtype='8bit' block-quantizes AdamW's m and v with torchao's AdamW8bit: the "
                         f"optimizer must be torch.optim.AdamW (or torchao.optim.AdamW8bit), not {type(opt).__name__}")
    if any(g.get("amsgrad") or g.get("maximize") for g in opt.param_groups):
        raise ValueError("state_dtype='8bit': amsgrad and maximize are not offered (torchao's AdamW8bit)")
    if any(len(s) for s in opt.state.values()):
        raise ValueError("state_dtype='8bit': the AdamW already holds FP32 state; set the recipe up before the "
                         "first step (a checkpoint of FP32 states does not load into 8-bit ones)")
    opt.__class__ = AdamW8bit
    opt.block_size, opt.bf16_stochastic_round, opt.is_adamw = BLOCK_SIZE, False, True
    for group in opt.param_groups:
        if not isinstance(group["lr"], torch.Tensor):
            group["lr"] = torch.tensor(group["lr"], dtype=torch.float32)
    opt._patch_step_function()
    if getattr(opt.__dict__.get("step"), "_wrapped_by_lr_sched", False):
        opt.step = _scheduler_step(opt)  # type: ignore[method-assign]
    return opt


def _scheduler_step(opt: Optimizer) -> Any:
    """torch's LR-scheduler step wrapper (``LRScheduler.__init__``), around ``type(opt).step``."""
    ref, func = weakref.ref(opt), type(opt).step

    @wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        this = ref()
        this._opt_called = True  # type: ignore[union-attr]
        return func.__get__(this, type(this))(*args, **kwargs)

    wrapper._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    return wrapper


def plain_state_checkpoints(opt: Optimizer) -> None:
    """Hook ``opt`` (once) so that its state dict holds torchao's quantized states as plain data and loading
    it makes them again (see the module)."""
    if getattr(opt, "_plain_state_checkpoints", False):
        return
    opt.register_state_dict_post_hook(_to_plain)
    opt.register_load_state_dict_pre_hook(_from_plain, prepend=True)  # before any hook that reads the states
    opt._plain_state_checkpoints = True  # type: ignore[attr-defined]


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
