"""``ExternalScaler``: a user's own ``GradScaler``-like object, driven the way Lightning drives it.

``MixedPrecision(scaler=...)`` takes a torch ``GradScaler``'s *settings* and
runs the core's scaler.  An object that is not a ``GradScaler`` but has its
API (``scale``, ``unscale_``, ``step``, ``update``: a third-party scaler, a
test double) is used as it is, as Lightning's own ``MixedPrecision`` uses it:

* the loss is ``scaler.scale(loss)``; after the closure ``scaler.unscale_``
  runs once, then ``scaler.step(optimizer)`` and ``scaler.update()``;
* the step/skip decision and the scale are the object's, so what needs the
  core's state is refused: FP32 masters and update rounding (only
  ``16-mixed`` accepts one), monitors, and gradient clipping with an optimizer
  that unscales inside its own step (``_step_supports_amp_scaling``, e.g.
  fused Adam), as Lightning refuses it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from mp_callbacks.loss_scale import ScalerConfig
from mp_callbacks.recipes import Recipe

from .scaler import TorchLossScaler, scaler_config_from, unwrap_optimizer

__all__ = ["ExternalScaler"]

_API = ("scale", "unscale_", "step", "update")


def is_external_scaler(value: Any) -> bool:
    """True for an object with ``GradScaler``'s API that is not a ``GradScaler`` nor one of our settings."""
    if value is None or isinstance(value, (torch.amp.GradScaler, ScalerConfig, str, Mapping)):
        return False
    return all(callable(getattr(value, name, None)) for name in _API)


def optimizer_unscales_in_step(optimizer: Any) -> bool:
    """True when ``optimizer.step`` unscales gradients itself (torch's ``_step_supports_amp_scaling``)."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))


class ExternalScaler:
    """The subset of :class:`~lightning_ext.loss_scale.TorchLossScaler` the plugin calls, forwarded to ``scaler``.

    Args:
      scaler: the user's object with ``scale``/``unscale_``/``step``/``update``.
      config: the recipe's scaler configuration (dynamic, skipping), for readers of ``config``.
    """

    external = True
    count_overflows: bool | None = None
    checks_overflow = True

    def __init__(self, scaler: Any, config: ScalerConfig) -> None:
        self.scaler = scaler
        self.config = config
        self._unscaled: set[int] = set()

    def to(self, device: Any) -> ExternalScaler:
        """No-op: the object places its own state."""
        return self

    def scale(self, outputs: Any) -> Any:
        """``scaler.scale(outputs)``."""
        return self.scaler.scale(outputs)

    def unscale_once(self, optimizer: Any) -> Tensor | None:
        """``scaler.unscale_(optimizer)`` once per step; None (the object keeps its own ``found_inf``)."""
        raw = unwrap_optimizer(optimizer)
        if id(raw) not in self._unscaled:
            self._unscaled.add(id(raw))
            self.scaler.unscale_(raw)
        return None

    def step(self, optimizer: Any, **kwargs: Any) -> Any:
        """``scaler.step(optimizer, **kwargs)``: the object decides whether the step is applied."""
        raw = unwrap_optimizer(optimizer)
        self._unscaled.discard(id(raw))
        return self.scaler.step(raw, **kwargs)

    def update(self) -> None:
        """``scaler.update()``."""
        self.scaler.update()

    def forget_step(self, optimizer: Any) -> None:
        """A closure without backward: nothing was unscaled."""
        self._unscaled.discard(id(unwrap_optimizer(optimizer)))

    def last_step_skipped(self, optimizer: Any | None = None) -> bool:
        """Unknown for an external object: False (LR schedulers step as under Lightning's plugin)."""
        return False

    def latest(self) -> dict[str, Tensor]:
        """No device statistics: the object keeps its own."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        """``scaler.state_dict()`` (Lightning saves it the same way)."""
        return dict(self.scaler.state_dict())

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """``scaler.load_state_dict(state_dict)``."""
        self.scaler.load_state_dict(state_dict)

    def attach_monitor(self, monitor: Any) -> None:
        """Refused: a monitor reads the core's scaler state, which an external scaler does not have."""
        raise ValueError(
            f"{type(monitor).__name__} needs the plugin's own loss scaler, not the external "
            f"{type(self.scaler).__name__}: "
            "pass scaler=torch.amp.GradScaler(...) (its settings are used), a ScalerConfig or a preset name.")

    def detach_monitor(self, monitor: Any) -> None:
        """Nothing is ever attached."""


def loss_scaler_for(value: Any, recipe: Recipe, count_overflows: bool | None = None,
                    divergence: Any = None) -> tuple[Recipe, TorchLossScaler | ExternalScaler]:
    """The plugin's ``scaler=``: an object with ``GradScaler``'s API is used as given (``16-mixed`` only);
    settings (a ``GradScaler``, a config, a preset, a dict; None: the recipe's) give an own scaler.
    Returns the recipe with those settings and the scaler."""
    if not is_external_scaler(value):
        recipe = recipe.with_scaler(scaler_config_from(value))
        return recipe, TorchLossScaler(recipe.scaler, count_overflows, divergence)
    if recipe.name != "16-mixed":
        unused = "" if recipe.scaler.enabled else f"`precision={recipe.name!r}` does not use a scaler, "
        raise ValueError(f"{unused}found {value!r}: an external scaler ({type(value).__name__}) works with "
                         f"precision='16-mixed' only, not {recipe.name!r}: pass its settings as a torch GradScaler "
                         "instead.")
    return recipe, ExternalScaler(value, recipe.scaler)
