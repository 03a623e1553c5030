"""``KerasLossScaler``: the core's loss-scaler state in Keras variables.

The state
(:class:`~mp_callbacks.loss_scale.scaler.ScalerState`: scale, growth tracker,
hysteresis, counters) lives in non-trainable scalar variables created on the
optimizer that owns this object (so they are saved, restored and mirrored
with it) and moves only by :func:`mp_callbacks.loss_scale.scaler.next_state` evaluated
with :class:`~keras_ext.ops.KerasOps` (no host read inside a traced
step).  Rules:

* :meth:`transition` computes the next state, reading only the fields the core can move in this
  configuration (:func:`~mp_callbacks.loss_scale.transition.moving_fields`: with scaling off the three
  counters steps, overflows, skipped); :meth:`write` assigns what moved, after the floor reaction;
* a floor hit (an overflow that asks for a backoff at ``min_scale``) reacts per
  ``on_min_scale``: eagerly through the core's
  :func:`~mp_callbacks.loss_scale.scaler.react_to_floor_hit`; inside a traced
  ``tf.function`` as a ``tf.debugging.Assert`` (``"raise"``) or a ``tf.print``
  (``"warn"``); under XLA, which has neither, only the ``floor_hits`` counter
  records it (a warning says so when the step is compiled);
* before :meth:`build` the counters read as the initial state.

:func:`scaler_config` turns ``LossScaleOptimizer``'s arguments into a config; the step's gradient
check and unscale are :mod:`keras_ext.loss_scale.check`.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import keras
import numpy as np
from keras import ops

from mp_callbacks.loss_scale import (
    STATE_FIELDS,
    ScaleFloorWarning,
    ScalerConfig,
    ScalerCounters,
    ScalerState,
    check_state_dict,
    fixed_scale,
    initial_state,
    make_state_dict,
    moving_fields,
    next_state,
    react_to_floor_hit,
)
from mp_callbacks.recipes import Recipe

from ..ops import KERAS_OPS, in_xla_context, is_tf, read_once, tracing

__all__ = ["KerasLossScaler", "VARIABLE_NAMES", "scaler_config"]

VARIABLE_NAMES = {field: "dynamic_scale" if field == "scale" else f"scaler_{field}" for field in STATE_FIELDS}
"""State field -> the optimizer variable's name (``dynamic_scale`` is Keras' own name for the scale)."""


def scaler_config(scaler: ScalerConfig | str | Mapping[str, Any] | None, recipe: Recipe | None = None,
                  initial_scale: float | None = None, dynamic_growth_steps: int | None = None) -> ScalerConfig:
    """The scaler a ``LossScaleOptimizer``'s arguments ask for: ``scaler`` (a config, preset name or
    dict; default: the recipe's, else the ``"keras"`` preset) with Keras' two arguments on top."""
    if scaler is None and recipe is not None:
        config = recipe.scaler
    else:
        config = ScalerConfig.coerce(scaler, default="keras")
    overrides: dict[str, Any] = {}
    if initial_scale is not None:
        overrides["init_scale"] = float(initial_scale)
    if dynamic_growth_steps is not None:
        overrides["growth_interval"] = int(dynamic_growth_steps)
    return config.replace(**overrides) if overrides else config


class KerasLossScaler(ScalerCounters):
    """The scaler state of one optimizer as Keras variables, advanced by the core transition.

    Args:
      config: the :class:`~mp_callbacks.loss_scale.config.ScalerConfig`.
    """

    def __init__(self, config: ScalerConfig) -> None:
        self.config = config
        self._vars: dict[str, Any] = {}
        self._old: ScalerState | None = None  # the state read by the last transition (write skips what it kept)

    # ------------------------------------------------------------ building
    @property
    def built(self) -> bool:
        """True once :meth:`build` created the variables."""
        return bool(self._vars)

    def build(self, optimizer: keras.optimizers.Optimizer) -> None:
        """Create the state variables on ``optimizer`` (in :data:`~mp_callbacks.loss_scale.STATE_FIELDS`
        order)."""
        init = initial_state(self.config)
        self._vars = {
            field: optimizer.add_variable(
                shape=(),
                dtype="float32" if field == "scale" else "int32",
                initializer=keras.initializers.Constant(float(getattr(init, field))),
                aggregation="none",
                name=VARIABLE_NAMES[field],
            )
            for field in STATE_FIELDS
        }

    # ------------------------------------------------------------- reading
    def variable(self, field: str) -> Any:
        """The variable of a state field (None before :meth:`build`)."""
        return self._vars.get(field)

    @property
    def state(self) -> ScalerState:
        """The state as backend scalars (variable values; the initial state before build)."""
        if not self._vars:
            return initial_state(self.config, KERAS_OPS)
        return ScalerState(*(ops.convert_to_tensor(self._vars[f]) for f in STATE_FIELDS))

    def plain_state(self) -> ScalerState:
        """The state as NumPy scalars (one host read per field)."""
        if not self._vars:
            return initial_state(self.config)
        return ScalerState(*(np.asarray(ops.convert_to_numpy(self._vars[f])) for f in STATE_FIELDS))

    def _counter(self, name: str) -> int:
        if not self._vars:
            return int(getattr(initial_state(self.config), name))
        return int(ops.convert_to_numpy(self._vars[name]))

    @property
    def current_scale(self) -> float:
        """The current loss scale as a Python float (one host read)."""
        if not self._vars:
            return float(initial_state(self.config).scale)
        return float(ops.convert_to_numpy(self._vars["scale"]))

    def scale_copy(self) -> Any:
        """The current scale as a new tensor (eager backends may update the variable's buffer in place)."""
        return ops.copy(self._vars["scale"].value)

    # ------------------------------------------------------------ stepping
    def transition(self, found_inf: Any, frozen: Any = None) -> tuple[ScalerState, Any]:
        """``(next state, applied)`` for this step's overflow flag (backend tensors, no host read).

        ``frozen`` (a 0-d bool, e.g. a latched divergence stop): when True the state stays and the
        step is not applied."""
        moving = moving_fields(self.config)  # the core neither reads nor changes the others: not read here
        old = ScalerState(*(read_once(self._vars[f]) if f in moving else None for f in STATE_FIELDS))
        self._old = old
        new, applied = next_state(self.config, old, found_inf, KERAS_OPS)
        if frozen is None:
            return new, applied
        # A field the core left as it was (the same object: it cannot move in this configuration) needs no select.
        return ScalerState(*(o if n is o else ops.where(frozen, o, n) for o, n in zip(old, new))), \
            ops.logical_and(applied, ops.logical_not(frozen))

    def step_scale(self) -> Any:
        """The scale this step runs with, for the divergence rule: the core's
        :func:`~mp_callbacks.loss_scale.transition.fixed_scale` (a Python float: no read) when the
        configuration holds it there, else the variable's value."""
        known = fixed_scale(self.config)
        return read_once(self._vars["scale"]) if known is None else known

    def write(self, new: ScalerState) -> None:
        """React to a floor hit of ``new`` (per ``on_min_scale``), then assign it to the variables.

        After :meth:`transition`, a field whose new value is the very state read it was computed from (the
        core returns it untouched when the configuration cannot move it: the scale with scaling off) is not
        written again, and no floor reaction is traced when ``floor_hits`` cannot move."""
        old, self._old = self._old, None
        unchanged = {f for f in STATE_FIELDS if old is not None and getattr(new, f) is getattr(old, f)}
        if self.config.on_min_scale != "clamp" and "floor_hits" not in unchanged:
            before = old.floor_hits if old is not None else self._vars["floor_hits"].value
            self._react_to_floor(ops.greater(new.floor_hits, before), new)
        for field in STATE_FIELDS:
            if field not in unchanged:
                self._vars[field].assign(getattr(new, field))

    def _react_to_floor(self, hit: Any, new: ScalerState) -> None:
        if not is_tf():
            if not tracing(hit):  # inside JAX's jit (no host reads) floor hits are only counted
                self._react_on_host(bool(ops.convert_to_numpy(hit)), new)
            return
        import tensorflow as tf

        if tf.executing_eagerly():
            self._react_on_host(bool(hit), new)
        elif in_xla_context():
            warnings.warn(
                f"keras_ext.LossScaleOptimizer: on_min_scale={self.config.on_min_scale!r} cannot act inside "
                "an XLA-compiled step (jit_compile=True); floor hits are only counted (optimizer.floor_hits)",
                ScaleFloorWarning,
                stacklevel=4,
            )
        elif self.config.on_min_scale == "raise":
            tf.debugging.Assert(
                tf.logical_not(hit),
                ["keras_ext: gradients overflowed while the loss scale sits at its floor; scale =", new.scale,
                 "min_scale =", self.config.min_scale, "step =", new.steps],
            )
        else:
            tf.cond(hit, lambda: tf.print("keras_ext warning: gradients overflowed at the scale floor; scale =",
                                          new.scale, "step =", new.steps), lambda: tf.no_op())

    def _react_on_host(self, hit: bool, new: ScalerState) -> None:
        if hit:
            steps, scale = int(ops.convert_to_numpy(new.steps)), float(ops.convert_to_numpy(new.scale))
            react_to_floor_hit(self.config, steps, scale, stacklevel=7)  # the caller of apply()

    # --------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The versioned plain-data record of the scaler (core schema)."""
        return make_state_dict(self.config, self.plain_state())

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`; a mismatch raises ``StateDictError``, before build a ``ValueError``."""
        clean = check_state_dict(self.config, state_dict)
        if not self._vars:
            raise ValueError(
                "build the optimizer (optimizer.build(model.trainable_variables)) before loading its state"
            )
        for field in STATE_FIELDS:
            self._vars[field].assign(clean[field])

    def reset(self) -> None:
        """Back to the config's initial state (a resume under another recipe restarts the scaler)."""
        init = initial_state(self.config)
        for field in STATE_FIELDS:
            self._vars[field].assign(getattr(init, field))

    def __repr__(self) -> str:
        return f"KerasLossScaler(scale={self.current_scale:g}, steps={self.steps}, overflows={self.overflows})"
