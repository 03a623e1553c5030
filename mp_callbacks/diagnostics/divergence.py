"""When a run cannot recover: the divergence rule both adapters apply by default.

A non-finite *loss* is a forward problem (an activation overflowed, bad data,
a learning rate that blew the weights up): no loss scale fixes it.  A gradient
overflow at a finite loss is what loss scaling handles, by backing off.  So:

* after ``nonfinite_losses`` consecutive steps whose loss is not finite, stop;
* after ``overflows_below`` consecutive overflow steps with a finite loss while
  the scale is already below ``scale_below`` (1.0: the loss is being *shrunk*
  and still overflows), stop.

Any applied step resets both streaks.  Every counted step was skipped, so
nothing non-finite reached the weights before the stop.  ``None`` turns a
rule off.  The scale-floor guard of the monitors (:class:`DivergenceGuard`: overflows
with the scale at its floor) is a separate, later net.  All three stop with one error,
:class:`DivergenceError`, whose advice comes from the one checklist
(:func:`mp_callbacks.advice.checklist`).

The rule is one pure transition, :func:`next_divergence_state`, written over
the array-ops protocol like the scaler's: :meth:`DivergenceRule.observe`
evaluates it with NumPy on the host (the Lightning plugin), the Keras optimizer
with ``keras.ops`` inside the traced step (streaks in device variables); both
raise :meth:`DivergenceRule.error`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from ..advice import checklist
from ..ops import NUMPY_OPS, Array, ArrayOps

__all__ = ["DivergenceError", "DivergenceGuard", "DivergenceRule", "DivergenceState", "moving_streaks",
           "next_divergence_state"]


class DivergenceError(RuntimeError):
    """Training cannot recover: non-finite losses, overflows below scale 1, or overflows at the scale floor.

    The message says what was seen (the streak, the step, the scale, the first non-finite
    module when known) and what to try (:func:`mp_callbacks.advice.checklist`).
    """


class DivergenceState(NamedTuple):
    """The streaks the rule keeps, as backend int32 scalars."""

    loss_streak: Array
    overflow_streak: Array


@dataclass
class DivergenceRule:
    """Stops a run after ``nonfinite_losses`` non-finite losses, or ``overflows_below`` overflows below
    scale ``scale_below``, in a row (None: that rule is off).  ``compute``: the run's compute dtype, when
    known, so that the advice does not suggest a switch to bfloat16 to a bfloat16 run."""

    nonfinite_losses: int | None = 5
    overflows_below: int | None = 10
    scale_below: float = 1.0
    compute: str | None = None
    loss_streak: int = 0
    overflow_streak: int = 0

    def __post_init__(self) -> None:
        for name in ("nonfinite_losses", "overflows_below"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"DivergenceRule.{name}={value!r} must be None or an integer >= 1")

    @classmethod
    def coerce(cls, value: DivergenceRule | Mapping[str, Any] | bool | None) -> DivergenceRule:
        """None or True: the default rule; False: both rules off; a dict: its fields; a rule: itself."""
        if value is None or value is True:
            return cls()
        if value is False:
            return cls(nonfinite_losses=None, overflows_below=None)
        if isinstance(value, DivergenceRule):
            return value
        if isinstance(value, Mapping):
            return cls(**dict(value))
        raise TypeError(f"divergence must be a DivergenceRule, a dict, True/False or None, not {type(value).__name__}")

    @property
    def active(self) -> bool:
        """True when at least one rule is on."""
        return self.nonfinite_losses is not None or self.overflows_below is not None

    def observe(self, step: int, overflow: bool, loss_finite: bool = True, scale: float = 1.0,
                module: str | None = None) -> None:
        """Feed one step (``overflow``: it was skipped for non-finite gradients); raises
        :class:`~mp_callbacks.diagnostics.meters.DivergenceError` when a streak reaches its limit.
        An applied step with no streak running changes nothing (limits are >= 1): no transition evaluated."""
        if not overflow and not self.loss_streak and not self.overflow_streak:
            return
        state = DivergenceState(np.int32(self.loss_streak), np.int32(self.overflow_streak))
        new, stop = next_divergence_state(self, state, overflow, loss_finite, scale)
        self.loss_streak, self.overflow_streak = int(new.loss_streak), int(new.overflow_streak)
        if bool(stop):
            raise self.error(step, scale, module)

    def error(self, step: int, scale: float = 1.0, module: str | None = None,
              state: DivergenceState | None = None) -> DivergenceError:
        """The :class:`DivergenceError` of a stop at ``step`` (``scale``: the scale the
        step ran with), for the streaks of ``state`` (default: this rule's)."""
        loss_streak = int(state.loss_streak) if state is not None else self.loss_streak
        overflow_streak = int(state.overflow_streak) if state is not None else self.overflow_streak
        where = f"; first non-finite module {module!r}" if module else ""
        if loss_streak:
            return DivergenceError(
                f"training diverged: the loss was not finite on {loss_streak} consecutive steps up to "
                f"step {step}{where}; none of them was applied. A non-finite loss comes from the forward "
                f"pass, and no loss scale fixes it. Try: {checklist('loss', self.compute, module)}.")
        return DivergenceError(
            f"training diverged: the gradients overflowed on {overflow_streak} consecutive steps with "
            f"a finite loss and the loss scale already below {self.scale_below:g} (scale={scale:g}) up to "
            f"step {step}{where}; none of them was applied. Try: {checklist('overflow', self.compute, module)}.")

    def state_dict(self) -> dict[str, Any]:
        """Plain data: the limits and the current streaks."""
        return {"nonfinite_losses": self.nonfinite_losses, "overflows_below": self.overflows_below,
                "scale_below": self.scale_below, "loss_streak": self.loss_streak,
                "overflow_streak": self.overflow_streak}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the streaks of a :meth:`state_dict` (the limits stay this rule's)."""
        self.loss_streak, self.overflow_streak = int(state["loss_streak"]), int(state["overflow_streak"])


class DivergenceGuard:
    """Stops a run whose scale sits at its floor for ``patience`` consecutive overflows."""

    def __init__(self, patience: int = 20, compute: str | None = None) -> None:
        if not isinstance(patience, int) or patience < 1:
            raise ValueError(f"DivergenceGuard patience={patience!r} must be an integer >= 1")
        self.patience = patience
        self.compute = compute
        self.streak = 0

    def observe(self, step: int, scale: float, min_scale: float, overflow: bool,
                module: str | None = None) -> None:
        """Feed one step; raises :class:`DivergenceError` when the streak reaches ``patience``."""
        if overflow and scale <= min_scale:
            self.streak += 1
        elif not overflow:
            self.streak = 0
        if self.streak >= self.patience:
            where = f", first non-finite module {module!r}" if module else ""
            raise DivergenceError(
                f"training diverged: {self.streak} consecutive overflows with the loss scale at its "
                f"floor (scale={scale:g}, min_scale={min_scale:g}) up to step {step}{where}. "
                f"Try: {checklist('floor', self.compute, module)}."
            )

    def state_dict(self) -> dict[str, int]:
        """Plain data: ``{"patience", "streak"}`` (the current run of overflows at the floor)."""
        return {"patience": self.patience, "streak": self.streak}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Restore a :meth:`state_dict` (patience and streak)."""
        self.patience, self.streak = int(state["patience"]), int(state["streak"])


def next_divergence_state(rule: DivergenceRule, state: DivergenceState, overflow: Array, loss_finite: Array,
                          scale: Array, ops: ArrayOps = NUMPY_OPS) -> tuple[DivergenceState, Array]:
    """One step of the rule: ``(new streaks, stop)``.

    ``overflow``: the step was skipped for non-finite gradients; ``loss_finite``:
    its loss was finite; ``scale``: the loss scale it ran with.  A skipped step
    with a non-finite loss extends the loss streak, one with a finite loss below
    ``rule.scale_below`` the overflow streak; every other step resets what it
    does not extend.  ``stop`` is True once a streak reaches its limit.  Pure
    and branch-free (traceable), like :func:`mp_callbacks.loss_scale.scaler.next_state`.
    """
    overflow = ops.boolean(overflow)
    finite = ops.boolean(loss_finite)
    one, zero = ops.i32(1), ops.i32(0)
    bad_loss = ops.logical_and(overflow, ops.logical_not(finite))
    if "overflow_streak" in moving_streaks(rule, scale):
        below = ops.logical_not(ops.greater_equal(ops.f32(scale), ops.f32(rule.scale_below)))
        bad_grads = ops.logical_and(ops.logical_and(overflow, finite), below)
        overflow_streak = ops.where(bad_grads, ops.add(ops.i32(state.overflow_streak), one), zero)
    else:  # a known scale at or above scale_below: the streak is reset on every step (not read)
        overflow_streak = zero
    new = DivergenceState(loss_streak=ops.where(bad_loss, ops.add(ops.i32(state.loss_streak), one), zero),
                          overflow_streak=overflow_streak)
    stop = ops.boolean(False)
    for streak, limit in ((new.loss_streak, rule.nonfinite_losses), (new.overflow_streak, rule.overflows_below)):
        if limit is not None and streak is not zero:  # a streak held at 0 never reaches a limit (>= 1)
            stop = ops.logical_or(stop, ops.greater_equal(streak, ops.i32(limit)))
    return new, stop


def moving_streaks(rule: DivergenceRule, scale: Any = None) -> tuple[str, ...]:
    """The streaks of :class:`DivergenceState` that can be non-zero after a step of :func:`next_divergence_state`.

    ``scale``: the scale the steps run with when it is a known number (a Python float: 1.0 with scaling
    off, :func:`mp_callbacks.loss_scale.transition.fixed_scale`), else anything (a backend scalar, None).
    A known scale at or above ``rule.scale_below`` never counts an overflow: the overflow streak is then
    0 after every step, and :func:`next_divergence_state` neither reads it nor compares it with its limit.

    >>> moving_streaks(DivergenceRule(), 1.0), moving_streaks(DivergenceRule(), 0.5)
    (('loss_streak',), ('loss_streak', 'overflow_streak'))
    """
    known = isinstance(scale, (int, float)) and not isinstance(scale, bool)
    if known and float(scale) >= rule.scale_below:
        return ("loss_streak",)
    return DivergenceState._fields
