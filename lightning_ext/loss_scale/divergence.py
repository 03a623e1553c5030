"""``TorchDivergence``: the core's divergence rule at the loss scaler's step decision.

The Keras adapter applies the same rule
(:class:`mp_callbacks.diagnostics.DivergenceRule`) and the same message
(:meth:`DivergenceRule.error`).  In torch the decision is on the host already
(the scaler reads ``found_inf`` once per step), so the rule runs there:

* :meth:`TorchDivergence.record_loss` (from ``scaler.scale(loss)``) keeps the scalar loss
  (detached: no op runs; whether it is finite is asked only on a skipped step);
* :meth:`TorchDivergence.observe` (from ``scaler.update``, with the step's decision) feeds the rule: an applied
  step resets the streaks for free; a skipped one costs one more host read (the
  loss flag, the scale the step ran with, its 1-based number) and raises
  :class:`~mp_callbacks.diagnostics.DivergenceError` when the run cannot recover.

So a Trainer and a Fabric loop get the rule with no call of their own: the
error comes out of ``optimizer.step()``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from mp_callbacks.diagnostics import DivergenceRule

__all__ = ["TorchDivergence"]


class TorchDivergence:
    """The divergence rule of one loss scaler.

    Args:
      rule: a :class:`~mp_callbacks.diagnostics.DivergenceRule`, a dict of its
        fields, True/None (the default rule) or False (off).
    """

    def __init__(self, rule: Any = None) -> None:
        self.rule = DivergenceRule.coerce(rule)
        self._loss: Tensor | None = None

    @property
    def active(self) -> bool:
        """True unless the rule is off."""
        return self.rule.active

    def record_loss(self, outputs: Any) -> None:
        """Keep a scalar loss (detached) for the next skipped step's question "was it finite?"; other
        outputs are ignored."""
        if self.rule.active and isinstance(outputs, Tensor) and outputs.numel() == 1:
            self._loss = outputs.detach()

    def applied(self) -> None:
        """An applied step: the streaks end (nothing is read)."""
        if self.rule.active:
            self.rule.observe(0, False)

    def observe(self, skipped: bool, grad_scale: Tensor, steps: Tensor) -> None:
        """Feed one step decision (``grad_scale``: the scale it ran with, ``steps``: transitions so far)."""
        if not self.rule.active:
            return
        if not skipped:
            self.rule.observe(0, False)
            return
        loss = self._loss
        finite = torch.isfinite(loss).reshape(()) if loss is not None else torch.ones((), dtype=torch.bool)
        device = grad_scale.device
        read = torch.stack([finite.to(device=device, dtype=torch.float64), grad_scale.double(),
                            steps.double() + 1]).tolist()
        self.rule.observe(int(read[2]), True, bool(read[0]), read[1])
