"""Hold step-interval LR schedulers on skipped optimizer steps.

Lightning steps ``interval="step"`` schedulers after every optimizer step
through the LightningModule hook ``lr_scheduler_step``.  The schedule counts
*applied* updates (the skip semantics), so while fitting :class:`SchedulerHold`
shadows that hook on the LightningModule instance with a wrapper that calls
the original (the user's override or Lightning's default) only when the
scheduler's optimizer applied its latest step.  Epoch-interval schedulers are
never held.  :meth:`SchedulerHold.remove` restores the class's hook.  Under
manual optimization the user steps schedulers (``plugin.last_step_skipped()``
says whether to).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["SchedulerHold"]

_MARK = "_mp_wrapped"


class SchedulerHold:
    """The ``lr_scheduler_step`` wrapper of one LightningModule.

    Args:
      skipped: ``skipped(optimizer or None) -> bool``: whether the latest step
        of that optimizer (None: of any optimizer) applied no update.
    """

    def __init__(self, skipped: Callable[[Any | None], bool]) -> None:
        self._skipped = skipped
        self._module: Any = None

    def install(self, module: Any) -> None:
        """Wrap ``module.lr_scheduler_step`` (idempotent)."""
        if getattr(vars(module).get("lr_scheduler_step"), _MARK, False):
            self._module = module
            return
        original = module.lr_scheduler_step
        hold = self

        def lr_scheduler_step(scheduler: Any, metric: Any = None) -> Any:
            if hold.holds(module, scheduler):
                return None
            return original(scheduler, metric)

        setattr(lr_scheduler_step, _MARK, True)
        lr_scheduler_step.__doc__ = "lightning_ext: holds step-interval schedulers on skipped optimizer steps."
        object.__setattr__(module, "lr_scheduler_step", lr_scheduler_step)
        self._module = module

    def remove(self) -> None:
        """Restore the module's own hook (idempotent)."""
        module, self._module = self._module, None
        if module is not None and getattr(vars(module).get("lr_scheduler_step"), _MARK, False):
            del module.__dict__["lr_scheduler_step"]

    def holds(self, module: Any, scheduler: Any) -> bool:
        """True when ``scheduler`` must not step now: step interval and its optimizer skipped."""
        trainer = getattr(module, "_trainer", None)
        configs = getattr(trainer, "lr_scheduler_configs", None) or []
        interval = next((c.interval for c in configs if c.scheduler is scheduler), "step")
        if interval != "step":
            return False
        return self._skipped(getattr(scheduler, "optimizer", None))
