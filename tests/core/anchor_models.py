"""Step-by-step models of anchors that cannot be installed here.

Each class follows its anchor's documented update rule, structured the way the
anchor's own code is (its variable names, its order of checks), so a test
compares our single transition against an independent statement of the rule.
All arithmetic is float32 where the anchor keeps the scale in a float32 tensor
(Megatron, tf-keras, jmp) and Python float where the anchor uses Python floats
(DeepSpeed, apex); with power-of-two factors both are exact.
"""

from __future__ import annotations

import numpy as np

f32 = np.float32


class TfKerasModel:
    """tf.keras.mixed_precision.LossScaleOptimizer (_DynamicLossScaleState.update)."""

    def __init__(self, initial_scale=2.0**15, growth_steps=2000, multiplier=2.0):
        self.scale, self.counter = f32(initial_scale), 0
        self.growth_steps, self.multiplier = growth_steps, f32(multiplier)

    def update(self, finite: bool) -> None:
        if finite:
            if self.counter + 1 >= self.growth_steps:
                new = self.scale * self.multiplier
                if np.isfinite(new):
                    self.scale = new
                self.counter = 0
            else:
                self.counter += 1
        else:
            self.scale = max(self.scale / self.multiplier, f32(1))
            self.counter = 0


class MegatronModel:
    """megatron.core.optimizer.grad_scaler.DynamicGradScaler.update."""

    def __init__(self, initial_scale=2.0**32, min_scale=1.0, growth_factor=2.0, backoff_factor=0.5,
                 growth_interval=1000, hysteresis=2):
        self.scale, self.min_scale = f32(initial_scale), f32(min_scale)
        self.growth_factor, self.backoff_factor = f32(growth_factor), f32(backoff_factor)
        self.growth_interval, self.hysteresis = growth_interval, hysteresis
        self.growth_tracker, self.hysteresis_tracker = 0, hysteresis

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.growth_tracker = 0
            self.hysteresis_tracker -= 1
            if self.hysteresis_tracker <= 0:
                self.scale = max(self.scale * self.backoff_factor, self.min_scale)
        else:
            self.growth_tracker += 1
            if self.growth_tracker == self.growth_interval:
                self.growth_tracker = 0
                self.hysteresis_tracker = self.hysteresis
                self.scale = self.scale * self.growth_factor


class DeepSpeedModel:
    """deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler.update_scale."""

    def __init__(self, init_scale=2.0**16, scale_factor=2.0, scale_window=1000, min_scale=1.0,
                 delayed_shift=2, consecutive_hysteresis=False, raise_error_at_min_scale=True):
        self.cur_scale, self.cur_iter, self.last_overflow_iter = init_scale, 0, -1
        self.scale_factor, self.scale_window, self.min_scale = scale_factor, scale_window, min_scale
        self.delayed_shift = self.cur_hysteresis = delayed_shift
        self.consecutive_hysteresis = consecutive_hysteresis
        self.raise_error_at_min_scale = raise_error_at_min_scale

    def update(self, overflow: bool) -> None:
        if overflow:
            if self.delayed_shift == 1 or self.cur_hysteresis == 1:
                if self.cur_scale == self.min_scale and self.raise_error_at_min_scale:
                    raise RuntimeError("Current loss scale already at minimum")
                self.cur_scale = max(self.cur_scale / self.scale_factor, self.min_scale)
            else:
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
        else:
            if self.consecutive_hysteresis:
                self.cur_hysteresis = self.delayed_shift
            if (self.cur_iter - self.last_overflow_iter) % self.scale_window == 0:
                if not self.consecutive_hysteresis:
                    self.cur_hysteresis = self.delayed_shift
                self.cur_scale *= self.scale_factor
        self.cur_iter += 1

    @property
    def scale(self):
        return self.cur_scale


class ApexModel:
    """apex.amp.scaler.LossScaler.update_scale (dynamic)."""

    def __init__(self, init_scale=2.0**16, scale_factor=2.0, scale_window=2000, min_loss_scale=None,
                 max_loss_scale=2.0**24):
        self.loss_scale, self.unskipped = init_scale, 0
        self.scale_factor, self.scale_window = scale_factor, scale_window
        self.min_loss_scale, self.max_loss_scale = min_loss_scale, max_loss_scale

    def update(self, has_overflow: bool) -> None:
        if has_overflow:
            if self.min_loss_scale:
                self.loss_scale = max(self.min_loss_scale, self.loss_scale / 2.0)
            else:
                self.loss_scale = self.loss_scale / 2.0
            self.unskipped = 0
        else:
            self.unskipped += 1
        if self.unskipped == self.scale_window:
            self.loss_scale = min(self.max_loss_scale, self.loss_scale * 2.0)
            self.unskipped = 0

    @property
    def scale(self):
        return self.loss_scale


class JmpModel:
    """jmp.DynamicLossScale.adjust."""

    def __init__(self, loss_scale=2.0**15, period=2000, factor=2, min_loss_scale=1.0):
        self.loss_scale, self.counter = f32(loss_scale), np.int32(0)
        self.period, self.factor, self.min_loss_scale = period, f32(factor), f32(min_loss_scale)

    def update(self, grads_finite: bool) -> None:
        grown = self.loss_scale * self.factor
        first_finite = grown if np.isfinite(grown) else self.loss_scale
        if grads_finite:
            loss_scale = first_finite if self.counter == self.period - 1 else self.loss_scale
        else:
            loss_scale = max(self.min_loss_scale, self.loss_scale / self.factor)
        self.counter = np.int32(((self.counter + 1) % self.period) * int(grads_finite))
        self.loss_scale = f32(loss_scale)

    @property
    def scale(self):
        return self.loss_scale
