"""The loss scaler's settings: :class:`ScalerConfig`, its validation, and the anchors' presets.

A config is plain, frozen, validated data (every out-of-range value is a
:class:`ConfigError` naming the field and what it allows); :data:`PRESETS`
holds the documented defaults of each anchor (torch, Keras, tf-keras,
Megatron, DeepSpeed, apex, jmp) as settings of the one rule in
:mod:`mp_callbacks.loss_scale.transition`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar

import numpy as np

from ..settings import ConfigError, Settings, is_int, is_number

FLOAT32_MAX = float(np.finfo(np.float32).max)
FLOAT32_TINY = 2.0**-126
"""The smallest normal float32: the lowest allowed ``min_scale`` and the floor of
presets whose anchor has none.  Below it ``1/scale`` overflows to inf in float32
(unscaling would turn finite gradients into inf/NaN) and CPUs that flush
subnormals turn the scale itself into 0."""

ON_MIN_SCALE_CHOICES = ("clamp", "warn", "raise")
"""Valid values of :attr:`ScalerConfig.on_min_scale`."""

@dataclasses.dataclass(frozen=True)
class ScalerConfig(Settings):
    """Settings of the dynamic loss scaler.

    Attributes:
      init_scale: the scale of the first step (> 0, finite, within
        ``[min_scale, max_scale]``).
      growth_factor: multiplier after ``growth_interval`` clean steps (> 1).
      backoff_factor: multiplier on an overflow that exhausts hysteresis (in (0, 1)).
      growth_interval: clean steps in a row before the scale grows (>= 1).
      hysteresis: overflows tolerated before a backoff (>= 1; 1 = back off on
        every overflow).  Refilled when the scale grows.
      consecutive_hysteresis: also refill hysteresis on every clean step.
      min_scale: the floor of the scale (>= 2**-126, so ``1/scale`` is finite).
      max_scale: the ceiling of the scale (finite, >= min_scale).
      on_min_scale: what a floor hit does: ``"clamp"``, ``"warn"`` or ``"raise"``.
      enabled: ``False`` turns loss scaling off (scale 1.0).
      dynamic: ``False`` keeps the scale at ``init_scale`` (steps with
        non-finite gradients are still skipped).
      skip_nonfinite: with scaling off, still skip a step whose gradients are
        not finite (nothing non-finite reaches the weights).  ``False`` applies
        every step and saves the per-step check (the last percent of speed).
        With scaling on every non-finite step is skipped regardless.
    """

    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    hysteresis: int = 1
    consecutive_hysteresis: bool = False
    min_scale: float = FLOAT32_TINY
    max_scale: float = FLOAT32_MAX
    on_min_scale: str = "clamp"
    enabled: bool = True
    dynamic: bool = True
    skip_nonfinite: bool = True

    what: ClassVar[str] = "a scaler"

    @property
    def can_skip(self) -> bool:
        """True when a step with non-finite gradients is skipped (scaling on, or ``skip_nonfinite``)."""
        return self.enabled or self.skip_nonfinite

    def __post_init__(self) -> None:
        self._validate()

    def _fail(self, name: str, allowed: str) -> None:
        value = getattr(self, name)
        raise ConfigError(f"ScalerConfig.{name}={value!r} is invalid: must be {allowed}")

    def _validate(self) -> None:
        for name in ("init_scale", "growth_factor", "backoff_factor", "min_scale", "max_scale"):
            value = getattr(self, name)
            if not is_number(value) or not math.isfinite(value):
                self._fail(name, "a finite number")
        for name in ("growth_interval", "hysteresis"):
            value = getattr(self, name)
            if not is_int(value) or value < 1:
                self._fail(name, "an integer >= 1")
        for name in ("consecutive_hysteresis", "enabled", "dynamic", "skip_nonfinite"):
            if not isinstance(getattr(self, name), bool):
                self._fail(name, "True or False")
        if self.growth_factor <= 1.0:
            self._fail("growth_factor", "> 1")
        if not 0.0 < self.backoff_factor < 1.0:
            self._fail("backoff_factor", "in the open interval (0, 1)")
        if not self.min_scale >= FLOAT32_TINY:
            self._fail("min_scale", f">= {FLOAT32_TINY:g} (2**-126, the smallest normal float32, "
                       "so that 1/scale stays finite)")
        if self.max_scale > FLOAT32_MAX:
            self._fail("max_scale", f"<= float32 max ({FLOAT32_MAX:g})")
        if self.max_scale < self.min_scale:
            self._fail("max_scale", f">= min_scale ({self.min_scale!r})")
        if not self.min_scale <= self.init_scale <= self.max_scale:
            self._fail("init_scale", f"in [min_scale, max_scale] = [{self.min_scale!r}, {self.max_scale!r}]")
        if self.on_min_scale not in ON_MIN_SCALE_CHOICES:
            self._fail("on_min_scale", f"one of {', '.join(ON_MIN_SCALE_CHOICES)}")

    # -- construction helpers -------------------------------------------------

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> ScalerConfig:
        """The configuration that reproduces the named anchor (see :data:`PRESETS`)."""
        if not isinstance(name, str) or name not in PRESETS:
            raise ConfigError(
                f"unknown scaler preset {name!r}; valid presets: {', '.join(sorted(PRESETS))}"
            )
        return dataclasses.replace(PRESETS[name], **overrides)

    @classmethod
    def from_name(cls, name: str | None, default: str = "torch") -> ScalerConfig:
        """A preset by name; ``None``: the ``default`` preset."""
        return cls.preset(default if name is None else name)


PRESETS: dict[str, ScalerConfig] = {  # name -> the anchor's documented defaults
    # torch.amp.GradScaler: no floor, grows only while the result is finite.
    "torch": ScalerConfig(init_scale=2.0**16, growth_interval=2000),
    # keras.optimizers.LossScaleOptimizer (Keras 3): 2**15, 2000 steps.  Keras
    # itself has no floor and no finite check on growth; ours stays finite and
    # positive where Keras's becomes inf or 0 (identical before that).
    "keras": ScalerConfig(init_scale=2.0**15, growth_interval=2000),
    # tf.keras.mixed_precision.LossScaleOptimizer (Keras 2): floor 1.
    "tf-keras": ScalerConfig(init_scale=2.0**15, growth_interval=2000, min_scale=1.0),
    # Megatron-LM DynamicGradScaler defaults (initial 2**32, window 1000, hysteresis 2, min 1).
    "megatron": ScalerConfig(init_scale=2.0**32, growth_interval=1000, hysteresis=2, min_scale=1.0),
    # DeepSpeed DynamicLossScaler with the fp16 config defaults
    # (initial_scale_power 16, loss_scale_window 1000, hysteresis 2, min 1,
    # raise_error_at_min_scale).
    "deepspeed": ScalerConfig(
        init_scale=2.0**16, growth_interval=1000, hysteresis=2, min_scale=1.0, on_min_scale="raise"
    ),
    # NVIDIA apex amp LossScaler: 2**16, window 2000, max 2**24, no floor.
    "apex": ScalerConfig(init_scale=2.0**16, growth_interval=2000, max_scale=2.0**24),
    # jmp.DynamicLossScale: period 2000, factor 2, min_loss_scale 1 (initial
    # scale as in jmp's README example, 2**15).
    "jmp": ScalerConfig(init_scale=2.0**15, growth_interval=2000, min_scale=1.0),
}
