"""Hold step-interval LR schedulers on skipped optimizer steps.

Lightning steps ``interval="step"`` schedulers after every optimizer step (through the LightningModule hook
``lr_scheduler_step``, which calls ``scheduler.step()``).  The schedule counts *applied* updates (the skip
semantics), so the Trainer plugin's ``connect`` returns the scheduler configurations with every step-interval
scheduler behind a :class:`HeldScheduler`: its ``step()`` steps the scheduler only when the scheduler's
optimizer applied its latest step; everything else (state dicts, attributes, the optimizer) is the
scheduler's.  Epoch-interval schedulers are never held.  Under manual optimization the user steps schedulers
(``plugin.last_step_skipped()`` says whether to) and nothing is wrapped.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

__all__ = ["HeldScheduler", "hold_schedulers"]


class HeldScheduler:
    """``scheduler`` with a ``step()`` that does nothing after a skipped optimizer step.

    Args:
      scheduler: a torch LR scheduler (anything with ``step``, ``optimizer``, ``state_dict``).
      skipped: ``skipped(optimizer) -> bool``: whether the latest step of that optimizer applied no update.
    """

    def __init__(self, scheduler: Any, skipped: Callable[[Any], bool]) -> None:
        self.scheduler = scheduler
        self._skipped = skipped

    def step(self, *args: Any, **kwargs: Any) -> None:
        """``scheduler.step(*args, **kwargs)`` unless its optimizer's latest step was skipped."""
        if not self._skipped(getattr(self.scheduler, "optimizer", None)):
            self.scheduler.step(*args, **kwargs)

    def state_dict(self) -> dict[str, Any]:
        """The scheduler's state dict."""
        return self.scheduler.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load the scheduler's state dict."""
        self.scheduler.load_state_dict(state_dict)

    def __getattr__(self, name: str) -> Any:
        if name == "scheduler":  # not set yet (unpickling)
            raise AttributeError(name)
        return getattr(self.scheduler, name)

    def __repr__(self) -> str:
        return f"HeldScheduler({self.scheduler!r})"


def hold_schedulers(configs: list[Any], skipped: Callable[[Any], bool]) -> list[Any]:
    """Lightning's ``LRSchedulerConfig`` list with every ``interval="step"`` scheduler behind a
    :class:`HeldScheduler` (new configurations; the others as given)."""
    out = []
    for config in configs:
        scheduler = getattr(config, "scheduler", None)
        if getattr(config, "interval", None) == "step" and scheduler is not None and (
                not isinstance(scheduler, HeldScheduler)):
            config = dataclasses.replace(config, scheduler=HeldScheduler(scheduler, skipped))
        out.append(config)
    return out
