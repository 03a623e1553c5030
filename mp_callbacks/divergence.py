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
rule off.  The scale-floor guard of the monitors
(:class:`~mp_callbacks.meters.DivergenceGuard`) is a separate, later net.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from .meters import DivergenceError

__all__ = ["DivergenceError", "DivergenceRule", "LOSS_CHECKLIST", "OVERFLOW_CHECKLIST"]

LOSS_CHECKLIST = (
    "check the inputs and labels for inf/NaN, lower the learning rate, keep more ops in FP32 "
    "(norms, softmax, losses, custom ops), switch float16 to bfloat16 (wider range), and turn on overflow "
    "attribution (MixedPrecisionMonitor(attribute_overflows=True)) to name the first non-finite module"
)
OVERFLOW_CHECKLIST = (
    "lower the learning rate, clip gradients, keep more ops in FP32 (norms, softmax, losses, custom ops) or "
    "switch float16 to bfloat16 (wider range)"
)


@dataclass
class DivergenceRule:
    """Stops a run after ``nonfinite_losses`` non-finite losses, or ``overflows_below`` overflows below
    scale ``scale_below``, in a row (None: that rule is off)."""

    nonfinite_losses: int | None = 5
    overflows_below: int | None = 10
    scale_below: float = 1.0
    loss_streak: int = 0
    overflow_streak: int = 0

    def __post_init__(self) -> None:
        for name in ("nonfinite_losses", "overflows_below"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"DivergenceRule.{name}={value!r} must be None or an integer >= 1")

    @classmethod
    def coerce(cls, value: "DivergenceRule | Mapping[str, Any] | bool | None") -> "DivergenceRule":
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
        :class:`~mp_callbacks.meters.DivergenceError` when a streak reaches its limit."""
        if not overflow:
            self.loss_streak = self.overflow_streak = 0
            return
        where = f"; first non-finite module {module!r}" if module else ""
        if not loss_finite:
            self.loss_streak += 1
            self.overflow_streak = 0
            if self.nonfinite_losses is not None and self.loss_streak >= self.nonfinite_losses:
                raise DivergenceError(
                    f"training diverged: the loss was not finite on {self.loss_streak} consecutive steps up to "
                    f"step {step}{where}; none of them was applied. A non-finite loss comes from the forward "
                    f"pass, and no loss scale fixes it. Try: {LOSS_CHECKLIST}.")
            return
        self.loss_streak = 0
        self.overflow_streak = self.overflow_streak + 1 if scale < self.scale_below else 0
        if self.overflows_below is not None and self.overflow_streak >= self.overflows_below:
            raise DivergenceError(
                f"training diverged: the gradients overflowed on {self.overflow_streak} consecutive steps with "
                f"a finite loss and the loss scale already below {self.scale_below:g} (scale={scale:g}) up to "
                f"step {step}{where}; none of them was applied. Try: {OVERFLOW_CHECKLIST}.")

    def state_dict(self) -> dict[str, Any]:
        """Plain data: the limits and the current streaks."""
        return {"nonfinite_losses": self.nonfinite_losses, "overflows_below": self.overflows_below,
                "scale_below": self.scale_below, "loss_streak": self.loss_streak,
                "overflow_streak": self.overflow_streak}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the streaks of a :meth:`state_dict` (the limits stay this rule's)."""
        self.loss_streak, self.overflow_streak = int(state["loss_streak"]), int(state["overflow_streak"])
