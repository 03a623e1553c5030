"""What training state costs: the bytes per parameter of a recipe's weights, gradients, masters and states.

The plan it counts is :class:`~mp_callbacks.weights.masters.MasterPlan` (which parameters get FP32
masters, the optimizer state dtype, update rounding).

Memory per parameter (model state only, no activations)::

    storage bytes (weight) + storage bytes (grad) + 4 (master, if any)
    + 4 * optimizer slots

AdamW under ``bf16-master``: 2 + 2 + 4 + 4 + 4 = 16 B/param.

That count keeps gradients in the storage dtype.  Framework optimizers need
the gradient in the dtype of the tensor they update, so at the optimizer step
both adapters hold the gradient as FP32 on the master (the low-precision
gradient is released first): ``fp32_master_grads=True`` counts that, 18
B/param for AdamW under ``bf16-master``.  Keras on TensorFlow instead widens
each gradient inside its own variable's update, one at a time (16 B/param,
``fp32_master_grads=False``; that FP32 gradient is a per-parameter temporary).  Nothing reads the low-precision
weights during the step (they are rebuilt from the masters after it), so an
adapter may release them for its duration (the Lightning plugin does):
``weights_released=True`` counts them as 0 at the step, 4 + 4 + 4 + 4 = 16
B/param for AdamW, the same peak as the end of the backward pass.

``master_remainders`` (:mod:`mp_callbacks.weights.remainders`) holds each FP32
master as the bf16 weight plus a 2-byte remainder: AdamW under
``bf16-master`` 2 + 2 + 2 + 4 + 4 = 14 B/param, the same exact masters.  The
step rebuilds the FP32 masters for the optimizer (in place of the weight and
remainder, which the Lightning plugin releases for the step), so the counts
at the step (``fp32_master_grads=True``) are those of an FP32 copy: 16 with
``weights_released``; the 2 B/param are saved between steps, where the
forward and backward passes add their activations.

Update rounding without masters (``bf16-kahan``, ``bf16-sr``,
:mod:`mp_callbacks.weights`): weights and gradients stay in the storage
dtype, ``bf16-kahan`` adds a compensation buffer in the storage dtype, the
optimizer states are FP32 (``state_dtype="bfloat16"`` halves them).  AdamW:
``bf16-kahan`` 2 + 2 + 2 + 8 = 14 B/param, ``bf16-sr`` 2 + 2 + 8 = 12; with
bf16 states 10 and 8.  ``state_dtype="8bit"`` (:mod:`mp_callbacks.weights.low_bit`) holds
each Adam moment of a large parameter as 1 B per element plus a float32 scale per 256 (and a 1 KiB map
per tensor): about 2.03 B/param for m and v, ``bf16-sr`` 6.03, ``bf16-master`` 10.03 between steps.
The optimizer updates one parameter at a time on an
FP32 copy of it, so beyond these figures a step holds the FP32 temporaries
of one parameter (like the optimizer's own per-parameter temporaries, not
counted).  Parameters the policy keeps in FP32 keep FP32 states.

``fp8-mixed`` stores what ``bf16-master`` stores (bf16 weights, FP32 masters,
FP32 states: AdamW 16 B/param at the step) plus the FP8 scaling state, which
grows with the number of FP8 matmuls, not with their size (``fp8_state``:
:func:`mp_callbacks.fp8.recipe.fp8_state_bytes`, ``3 * (4 * history_len + 16)``
bytes per matmul).  The FP8 copies of weights and inputs are transient
(activations, :func:`~mp_callbacks.fp8.recipe.fp8_transient_bytes`), not model state.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

from ..dtypes import dtype_bytes
from ..weights import MasterPlan
from .low_bit import EIGHT_BIT, LOW_BIT_STATES

EIGHT_BIT_OPTIMIZERS = ("adam", "adamw")
"""Optimizers whose states ``state_dtype="8bit"`` holds block-quantized."""

OPTIMIZER_SLOTS: dict[str, int] = {
    "sgd": 0, "sgd-momentum": 1, "momentum": 1, "nesterov": 1, "adam": 2, "adamw": 2,
    "adamax": 2, "nadam": 2, "radam": 2, "lamb": 2, "rmsprop": 1, "adagrad": 1, "adadelta": 2,
    "lion": 1,
}
"""Optimizer name (lower case, ``-`` for ``_``) -> state tensors it keeps per parameter, each of the
parameter's size in ``MasterPlan.state_dtype`` (Adam: m and v; SGD with momentum: the momentum buffer).
Scalar bookkeeping (step counters, learning rates) is not counted."""


def optimizer_kind(name: str, momentum: float = 0.0) -> str:
    """The :data:`OPTIMIZER_SLOTS` key of a framework optimizer: its class name lower-cased,
    ``"sgd"`` becoming ``"sgd-momentum"`` when ``momentum`` is non-zero (the buffer it then keeps).

    ``optimizer_kind("SGD", 0.9) == "sgd-momentum"``, ``optimizer_kind("AdamW") == "adamw"``.
    Unknown names pass through (:func:`optimizer_slots` rejects them).
    """
    kind = str(name).lower().replace("_", "-")
    if kind == "sgd" and momentum:
        kind = "sgd-momentum"
    return kind


def optimizer_slots(optimizer: str) -> int:
    """FP32 state tensors per parameter for an optimizer name (case-insensitive)."""
    key = str(optimizer).lower().replace("_", "-")
    if key not in OPTIMIZER_SLOTS:
        raise ValueError(f"unknown optimizer {optimizer!r}; known: {', '.join(sorted(OPTIMIZER_SLOTS))}")
    return OPTIMIZER_SLOTS[key]


@dataclass(frozen=True)
class MemoryEstimate:
    """Model-state bytes, split by what holds them."""

    params: int
    weights: int
    grads: int
    masters: int
    optimizer_state: int
    compensation: int = 0
    fp8_state: int = 0

    @property
    def total(self) -> int:
        """All model-state bytes: weights + grads + masters + optimizer state + compensation buffers
        + FP8 scaling state (``fp8-mixed``)."""
        return self.weights + self.grads + self.masters + self.optimizer_state + self.compensation + self.fp8_state

    @property
    def bytes_per_param(self) -> float:
        """:attr:`total` per parameter (0.0 for no parameters)."""
        return self.total / self.params if self.params else 0.0

    def __add__(self, other: MemoryEstimate) -> MemoryEstimate:
        """Field-wise sum (the model state of two optimizers' parameters together)."""
        return MemoryEstimate(self.params + other.params, self.weights + other.weights, self.grads + other.grads,
                              self.masters + other.masters, self.optimizer_state + other.optimizer_state,
                              self.compensation + other.compensation, self.fp8_state + other.fp8_state)

    def to_dict(self) -> dict[str, float]:
        """Plain data: every field (``fp8_state`` only when non-zero) plus ``total`` and ``bytes_per_param``."""
        fp8 = {"fp8_state": self.fp8_state} if self.fp8_state else {}
        return {"params": self.params, "weights": self.weights, "grads": self.grads,
                "masters": self.masters, "optimizer_state": self.optimizer_state,
                "compensation": self.compensation, **fp8, "total": self.total, "bytes_per_param": self.bytes_per_param}


def estimate_memory(
    plan: MasterPlan, optimizer: str, params: Iterable[tuple[int, str]] | int,
    fp32_master_grads: bool = False, weights_released: bool = False, n_shards: int | None = None,
    fp8_state: int = 0,
) -> MemoryEstimate:
    """Bytes of model state for ``params``: an int (all stored in ``plan.param_dtype``)
    or ``(numel, storage_dtype)`` pairs (FP32-kept parameters included).

    ``fp32_master_grads``: count the gradient of a parameter with a master as
    FP32 (what the adapters hold at the optimizer step) instead of its storage dtype.
    ``weights_released``: with ``fp32_master_grads``, the low-precision weight of a
    parameter with a master is released during the step and counts 0.
    Without masters (``kahan``/``stochastic`` rounding) neither applies: the
    weight and gradient stay in the storage dtype, ``kahan`` adds a
    compensation buffer of the weight's size and dtype.

    ``n_shards``: what ONE rank holds when parameters, gradients and optimizer
    states are sharded ``n_shards`` ways (FSDP2 ``fully_shard``, FSDP1):
    every parameter is kept as an FP32 shard (under ``*-master`` that shard
    IS the master: counted in ``masters``, no low-precision weight persists),
    its gradient shard is FP32 and the states are FP32 shards; each tensor's
    ``numel / n_shards`` is rounded up.  AdamW: ``16 / n_shards`` B/param in
    every recipe.  Not counted: the transient low-precision all-gather of the
    unit being computed and its unsharded gradient before the reduce-scatter.
    ``params`` stays the global count.  Update rounding (``bf16-kahan``,
    ``bf16-sr``) has no sharded form (``ValueError``).

    ``fp8_state``: bytes of FP8 scaling state (``fp8-mixed``; every rank holds all of it), from
    :func:`mp_callbacks.fp8.recipe.fp8_state_bytes`.

    ``optimizer`` may name a low-bit optimizer (``adamw8bit``, ``adamw4bit``, ``adamwfp8``...): its states
    follow :data:`~mp_callbacks.memory.low_bit.LOW_BIT_STATES` (quantized for large parameters); so do
    Adam's and AdamW's under ``state_dtype="8bit"`` (:data:`~mp_callbacks.memory.low_bit.EIGHT_BIT`, whatever
    the parameter's storage dtype; any other optimizer is a ``ValueError``).
    """
    if n_shards is not None:
        return replace(_sharded_estimate(plan, optimizer, params, int(n_shards)), fp8_state=int(fp8_state))
    if weights_released and not fp32_master_grads:
        raise ValueError("weights_released=True describes the optimizer step: pass fp32_master_grads=True too")
    if isinstance(params, int):
        params = [(params, plan.param_dtype)]
    low_bit = LOW_BIT_STATES.get(optimizer_kind(optimizer)) or _eight_bit(plan, optimizer)
    slots = 0 if low_bit is not None else optimizer_slots(optimizer)
    n = w = g = m = s = c = 0
    for numel, dtype in params:
        size = dtype_bytes(dtype)
        n += numel
        if plan.needs_master(dtype):
            w += 0 if weights_released else numel * size
            m += numel * (4 if fp32_master_grads else plan.master_bytes(dtype))  # the step rebuilds FP32 masters
            g += numel * (4 if fp32_master_grads else size)
        else:
            w += numel * size
            g += numel * size
        if plan.needs_compensation(dtype):
            c += numel * size
        s += numel * slots * plan.state_bytes(dtype)
        if low_bit is not None:  # torchao's block-quantized states (mp_callbacks.memory.low_bit)
            s += low_bit.slots * low_bit.slot_bytes(numel, plan.state_bytes(dtype))
    return MemoryEstimate(params=n, weights=w, grads=g, masters=m, optimizer_state=s, compensation=c,
                          fp8_state=int(fp8_state))


def _eight_bit(plan: MasterPlan, optimizer: str) -> Any:
    """The 8-bit layout when ``plan`` quantizes states (Adam/AdamW only, else ``ValueError``), else None."""
    if not plan.quantized_states:
        return None
    if optimizer_kind(optimizer) not in EIGHT_BIT_OPTIMIZERS:
        raise ValueError(f"state_dtype='8bit' block-quantizes Adam's m and v: optimizer {optimizer!r} is not "
                         f"one of {', '.join(EIGHT_BIT_OPTIMIZERS)}")
    return EIGHT_BIT


def _sharded_estimate(plan: MasterPlan, optimizer: str, params: Iterable[tuple[int, str]] | int,
                      n_shards: int) -> MemoryEstimate:
    """:func:`estimate_memory` with ``n_shards``: one rank's FP32 shards (see there)."""
    if n_shards < 1:
        raise ValueError(f"n_shards must be at least 1, not {n_shards}")
    if plan.rounds_updates:
        raise ValueError(f"update_rounding={plan.update_rounding!r} keeps low-precision weights without masters; "
                         "sharded training (FSDP) keeps FP32 shards: use a *-master recipe there")
    if isinstance(params, int):
        params = [(params, plan.param_dtype)]
    slots = optimizer_slots(optimizer)
    n = w = g = m = s = 0
    for numel, dtype in params:
        local = -(-int(numel) // n_shards)
        n += numel
        if plan.needs_master(dtype):
            m += 4 * local  # the FP32 shard is the master
        else:
            w += 4 * local
        g += 4 * local
        s += slots * 4 * local
    return MemoryEstimate(params=n, weights=w, grads=g, masters=m, optimizer_state=s)


def bytes_per_param(plan: MasterPlan, optimizer: str, fp32_master_grads: bool = False,
                    weights_released: bool = False, n_shards: int | None = None) -> float:
    """Bytes of model state per parameter when every parameter uses ``plan.param_dtype``
    (per rank with ``n_shards``, see :func:`estimate_memory`).

    ``bytes_per_param(get_recipe("bf16-kahan").master, "adamw") == 14.0`` (2 + 2 + 2 + 8).
    """
    if n_shards is not None:  # n_shards parameters: one element per rank, no rounding
        return estimate_memory(plan, optimizer, n_shards, n_shards=n_shards).bytes_per_param
    return estimate_memory(plan, optimizer, 1, fp32_master_grads, weights_released).bytes_per_param


def is_optimizer_state(shape: Iterable[int]) -> bool:
    """Whether an optimizer tensor of ``shape`` counts as optimizer state in a memory report.

    Rule (both adapters): tensors with at least one dimension (the per-parameter
    slots: momentum, Adam's m and v) count; scalars (step counters, the
    iteration count, the learning rate) are bookkeeping, as in :data:`OPTIMIZER_SLOTS`.
    """
    return len(tuple(shape)) > 0


def memory_report(
    recipe: str, plan: MasterPlan, optimizers: Iterable[tuple[str, float, Iterable[tuple[int, str]]]],
    actual: MemoryEstimate, weights_released: bool = False, n_shards: int | None = None, fp8_state: int = 0,
    fp32_master_grads: bool = True,
) -> dict[str, Any]:
    """What both monitors report: bytes of model state held, next to :func:`estimate_memory`.

    ``optimizers``: one ``(class name, momentum, [(numel, storage dtype) of its
    parameters])`` per optimizer.  ``actual``: what the adapter measured
    (``optimizer_state`` per :func:`is_optimizer_state`).  The estimate is taken
    at the optimizer step (``fp32_master_grads`` and ``weights_released`` as
    the adapter does: Keras on TensorFlow widens each gradient inside its own
    update, ``fp32_master_grads=False``) and is None when an optimizer is unknown to the core.
    ``n_shards``: sharded training, one rank's share (:func:`estimate_memory`).
    ``fp8_state``: the FP8 scaling state's bytes (``fp8-mixed``), added once to the estimate.

    Returns plain data: ``{"recipe", "master_weights", "optimizers": [kind...],
    "actual": actual.to_dict(), "estimate": dict | None}``.
    """
    names: list[str] = []
    estimate: MemoryEstimate | None = None
    known = True
    for class_name, momentum, params in optimizers:
        kind = optimizer_kind(class_name, momentum)
        if kind not in OPTIMIZER_SLOTS and kind not in LOW_BIT_STATES:
            names.append(f"{kind} (unknown to the core)")
            known = False
            continue
        names.append(kind)
        part = (estimate_memory(plan, kind, list(params), n_shards=n_shards) if n_shards is not None else
                estimate_memory(plan, kind, list(params), fp32_master_grads=fp32_master_grads,
                                weights_released=weights_released))
        estimate = part if estimate is None else estimate + part
    if estimate is not None and fp8_state:
        estimate = replace(estimate, fp8_state=int(fp8_state))
    sharding = {} if n_shards is None else {"n_shards": int(n_shards)}
    return {"recipe": recipe, "master_weights": plan.master_weights, "optimizers": names, **sharding,
            "actual": actual.to_dict(), "estimate": estimate.to_dict() if known and estimate is not None else None}
