"""Overflow attribution: the one blame order both frameworks apply, and the auto-fallback count.

* :data:`LOSS_SOURCE`: the attribution name used when the loss itself is
  non-finite while every module's forward output was finite.
* :func:`first_culprit` / :func:`attribution_order`: the one blame order of
  overflow attribution (forward outputs, then the loss, then gradients).
* :class:`FallbackTracker`: overflows blamed per module; a module that reaches the
  threshold moves to FP32 (auto-fallback; never :data:`LOSS_SOURCE`: the loss is no module).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

LOSS_SOURCE = "<loss>"
"""Overflow attribution when the loss is non-finite but no module output was (never moved to FP32)."""


def attribution_order(forward: Sequence[str], backward: Sequence[str]) -> list[str]:
    """Every attribution candidate in blame order: ``forward`` (module outputs in call order),
    :data:`LOSS_SOURCE`, then ``backward`` (gradients in backward, i.e. reverse-call, order).

    The first non-finite entry of this list is :func:`first_culprit`'s answer;
    an adapter that picks the culprit on the device (Keras) builds its name
    table with this function and takes the first flagged index.
    """
    return [*forward, LOSS_SOURCE, *backward]


def first_culprit(forward_bad: Sequence[str], loss_bad: bool, backward_bad: Sequence[str]) -> str | None:
    """The module blamed for an overflow step, None when nothing non-finite was seen.

    The order (both frameworks):

    1. the first module whose forward output was non-finite, in call order
       (``forward_bad``: the non-finite forward records, in call order);
    2. else the loss itself (``loss_bad``): :data:`LOSS_SOURCE`;
    3. else the first module whose gradient (its input gradient or its own
       parameters' gradients) was non-finite, in backward (reverse-call)
       order (``backward_bad``: the non-finite gradient records, in that order).
    """
    if forward_bad:
        return forward_bad[0]
    if loss_bad:
        return LOSS_SOURCE
    return backward_bad[0] if backward_bad else None


class FallbackTracker:
    """Counts overflows blamed on each module; names a module once it reaches ``threshold``."""

    def __init__(self, threshold: int = 3) -> None:
        if not isinstance(threshold, int) or threshold < 1:
            raise ValueError(f"FallbackTracker threshold={threshold!r} must be an integer >= 1")
        self.threshold = threshold
        self.blame: dict[str, int] = {}
        self.moved: list[str] = []

    def blame_module(self, module: str) -> bool:
        """Record one overflow on ``module``; True exactly when it must move to FP32 now."""
        if module in self.moved:
            return False
        self.blame[module] = self.blame.get(module, 0) + 1
        if self.blame[module] >= self.threshold:
            self.moved.append(module)
            return True
        return False

    def state_dict(self) -> dict[str, Any]:
        """Plain data: ``{"threshold", "blame": {module: overflows}, "moved": [modules in FP32, in order]}``."""
        return {"threshold": self.threshold, "blame": dict(self.blame), "moved": list(self.moved)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict` (threshold, blame counts, moved modules)."""
        self.threshold = int(state["threshold"])
        self.blame = {str(k): int(v) for k, v in state["blame"].items()}
        self.moved = [str(m) for m in state["moved"]]
