"""``GradScalerSettings``: the part of torch ``GradScaler``'s API that reads and sets a scaler's settings.

:class:`~lightning_ext.scaler.TorchLossScaler` takes it first among its bases, so these methods, not
``GradScaler``'s, answer (no ``GradScaler`` method runs unless the scaler's classes define it).  The rule of
each: a getter returns the configuration's field (``get_scale``: the current scale, one host read; 1.0 with
scaling off), a setter replaces the field through :meth:`ScalerConfig.replace` (validated), and
``_per_optimizer_states`` shows the scale -> unscale -> step cycle in ``GradScaler``'s own shape for code
that reads it.  What the mixin reads of its host class: ``config`` (a
:class:`~mp_callbacks.loss_scale.config.ScalerConfig`), ``_mirror`` (the
:class:`~lightning_ext.scaler_state.ScalerStateMirror`), ``_state`` and ``_stages``
(``{id(optimizer): (OptState, found_inf)}``).
"""

from __future__ import annotations

import enum
from collections import defaultdict
from typing import Any

from mp_callbacks.loss_scale import ScalerConfig

__all__ = ["GradScalerSettings", "OptState"]


class OptState(enum.Enum):
    """Where an optimizer is in the scale -> unscale -> step -> update cycle."""

    READY = 0
    UNSCALED = 1
    STEPPED = 2


class GradScalerSettings:
    """``GradScaler``'s getters and setters of the scale and its settings (see the module's rule)."""

    config: ScalerConfig
    _stages: dict[int, tuple[OptState, Any]]

    def is_enabled(self) -> bool:
        """True when the loss is scaled."""
        return self.config.enabled

    def get_scale(self) -> float:
        """The current scale as a Python float (one host read; 1.0 with scaling disabled)."""
        host = self._mirror.host
        return float(host.scale) if host is not None else float(self._state.scale.item())

    def get_growth_factor(self) -> float:
        """``growth_factor`` of the configuration."""
        return self.config.growth_factor

    def get_backoff_factor(self) -> float:
        """``backoff_factor`` of the configuration."""
        return self.config.backoff_factor

    def get_growth_interval(self) -> int:
        """``growth_interval`` of the configuration."""
        return self.config.growth_interval

    def set_growth_factor(self, new_factor: float) -> None:
        """Replace ``growth_factor`` (validated by :class:`ScalerConfig`)."""
        self.config = self.config.replace(growth_factor=float(new_factor))

    def set_backoff_factor(self, new_factor: float) -> None:
        """Replace ``backoff_factor`` (validated by :class:`ScalerConfig`)."""
        self.config = self.config.replace(backoff_factor=float(new_factor))

    def set_growth_interval(self, new_interval: int) -> None:
        """Replace ``growth_interval`` (validated by :class:`ScalerConfig`)."""
        self.config = self.config.replace(growth_interval=int(new_interval))

    @property
    def _per_optimizer_states(self) -> dict[int, dict[str, Any]]:
        """torch ``GradScaler``'s per-optimizer record (``{id: {"stage", "found_inf_per_device"}}``), for
        code that reads it; an optimizer not in the cycle is ``READY``."""
        out: dict[int, dict[str, Any]] = defaultdict(lambda: {"stage": OptState.READY, "found_inf_per_device": {}})
        for key, (stage, found) in self._stages.items():
            out[key] = {"stage": stage, "found_inf_per_device": {} if found is None else {found.device: found}}
        return out
