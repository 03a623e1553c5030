"""What :class:`keras_ext.LossScaleOptimizer` shows and saves: the scaler's state, its record, the Keras config.

:class:`OptimizerRecord` is a base class of the optimizer (the step is :mod:`keras_ext.optimizer`'s).  The rules:

* reads of the state are device values (``dynamic_scale``, ``step_counter``, ``scaler_state``) except
  :attr:`~OptimizerRecord.current_scale` and :meth:`~OptimizerRecord.scaler_metrics`, one host read each;
* :meth:`~OptimizerRecord.scaler_state_dict` is the core's versioned plain-data record; loading another
  config raises ``StateDictError``;
* ``get_config`` is shaped like Keras' own, plus only what differs from what the constructor derives
  (so ``from_config`` also reads Keras' own ``LossScaleOptimizer.get_config``).

It uses the optimizer's ``_scaler``, ``_masters``, ``_divergence``, ``_recipe``, ``_recipe_given``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Self

import keras

from mp_callbacks.diagnostics import OVERFLOW, StepStats
from mp_callbacks.loss_scale import ScalerState

from .scaler import scaler_config

__all__ = ["OptimizerRecord"]


class OptimizerRecord:
    """State reads, the scaler record and the Keras config of :class:`keras_ext.LossScaleOptimizer`."""

    # -- reading the state -----------------------------------------------------------
    @property
    def dynamic_scale(self) -> Any:
        """The current loss scale: a float32 Keras variable once built, else the initial scale."""
        scale = self._scaler.variable("scale")
        return self.initial_scale if scale is None else scale

    @property
    def step_counter(self) -> Any:
        """Keras' name for the growth tracker (clean steps since the last change)."""
        return self._scaler.variable("growth_tracker")

    @property
    def scaler_state(self) -> ScalerState:
        """The state as backend scalars (variable values); the initial state before build."""
        return self._scaler.state

    def _counter(self, field: str) -> int:
        return getattr(self._scaler, field)

    @property
    def current_scale(self) -> float:
        """The current loss scale as a Python float (one host read)."""
        return self._scaler.current_scale

    @property
    def master_variables(self) -> list[Any]:
        """FP32 master copies, aligned with the trainable variables (None: the variable is its own master);
        under ``master_remainders`` :class:`~keras_ext.remainders.RemainderMaster` views (joined on read)."""
        return self._masters.variables

    def scaler_metrics(self) -> dict[str, float]:
        """The shared names of the scale and the counters (``mp/scale``, ``mp/overflows_total``...) -> values."""
        stats = StepStats.from_counts(self.steps, self.current_scale, False, self.overflows, self.skipped,
                                      self.growths)
        return {k: v for k, v in stats.metrics().items() if k != OVERFLOW}

    def scaler_state_dict(self) -> dict[str, Any]:
        """The versioned plain-data record of the scaler (core schema)."""
        return self._scaler.state_dict()

    def load_scaler_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore the scaler from :meth:`scaler_state_dict`; a mismatch raises ``StateDictError``."""
        self._scaler.load_state_dict(state_dict)

    # -- serialization ----------------------------------------------------------------------
    def get_config(self) -> dict[str, Any]:
        """Plain data shaped like Keras' own (``name``, ``inner_optimizer``, ``initial_scale``,
        ``dynamic_growth_steps``); ``scaler``, ``master_weights``, ``count_overflows``, ``recipe`` and
        ``divergence`` only where they differ from what the constructor derives from the others."""
        config = {"name": self.name, "inner_optimizer": keras.saving.serialize_keras_object(self.inner_optimizer),
                  "initial_scale": self.scaler_config.init_scale,
                  "dynamic_growth_steps": self.scaler_config.growth_interval}
        given = self._recipe_given
        if given is None and self.update_rounding is not None:  # the global recipe's rounding: keep it
            given = self._recipe
        if given is not None:
            config["recipe"] = given.to_dict()
        if self.scaler_config != scaler_config(None, given, config["initial_scale"], config["dynamic_growth_steps"]):
            config["scaler"] = self.scaler_config.to_dict()
        if self.master_weights != (given.master.master_weights if given is not None else False):
            config["master_weights"] = self.master_weights
        if self.count_overflows is not None:
            config["count_overflows"] = self.count_overflows
        if self._divergence.rule_config() is not None:
            config["divergence"] = self._divergence.rule_config()
        if self.update_rounding is not None and self.update_rounding.seed:
            config["seed"] = self.update_rounding.seed
        return config

    @classmethod
    def from_config(cls, config: Mapping[str, Any], custom_objects: Any = None) -> Self:
        """Inverse of :meth:`get_config` (also of Keras' own ``LossScaleOptimizer.get_config``)."""
        config = dict(config)
        inner = keras.saving.deserialize_keras_object(config.pop("inner_optimizer"), custom_objects=custom_objects)
        return cls(inner, **config)
