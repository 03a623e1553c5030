"""FP32 master weights inside a Keras optimizer (the ``*-master`` recipes).

The core's rule
(:mod:`mp_callbacks.memory.estimate`): a variable stored in float16/bfloat16 gets an
FP32 master; the inner optimizer is built on (and updates) the master, so its
slots are FP32; after every *applied* step the master is rounded back into the
low-precision variable.  Variables kept in FP32 are their own master.  In Keras:

* :meth:`MasterWeights.build` creates the masters as optimizer variables (saved
  and restored with the optimizer, mirrored under ``tf.distribute``),
  initialized from the variable's value when they are created (from the FP32 value
  it was rounded from, when :func:`keras_ext.apply_policy` kept it and the variable
  still holds its rounding: a master starts where an FP32 run starts), and returns
  what the inner optimizer is built on;
* :meth:`MasterWeights.targets` gives, for one step, what the inner optimizer
  updates and the gradients it gets (FP32 for a master);
* :meth:`MasterWeights.write_back` rounds the masters into the variables.

At the step every gradient of a variable with a master is widened to FP32 before the inner optimizer
runs (the core's count with ``fp32_master_grads=True``: AdamW 18 B/param at the step); under XLA
(``jit_compile=True``) the compiler fuses the widening into each variable's update.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import keras
from keras import ops

from ..ops import dtype_name, is_tf

__all__ = ["FP32_SOURCE", "LOW_PRECISION", "MasterWeights"]

FP32_SOURCE = "_mp_fp32_source"
"""Attribute of a low-precision variable: the FP32 value it was rounded from (until its master takes it)."""

LOW_PRECISION = ("float16", "bfloat16")
"""Storage dtypes that get an FP32 master."""


class MasterWeights:
    """The FP32 masters of one optimizer, aligned with its trainable variables.

    Args:
      enabled: keep masters (False: every variable is its own master).
    """

    def __init__(self, enabled: bool) -> None:
        if not isinstance(enabled, bool):
            raise TypeError(f"master_weights must be True or False, not {enabled!r}")
        self.enabled = enabled
        self._masters: list[Any] = []

    @property
    def variables(self) -> list[Any]:
        """The masters, aligned with the trainable variables (None: the variable is its own master)."""
        return list(self._masters)

    def build(self, optimizer: keras.optimizers.Optimizer, var_list: Sequence[Any]) -> list[Any]:
        """Create a master on ``optimizer`` for each low-precision variable; return what the inner
        optimizer is built on (the master, or the variable itself)."""
        self._masters = []
        built_in_trace = [_label(v) for v in var_list if self.enabled and dtype_name(v) in LOW_PRECISION
                          and _created_in_trace(v)]
        if built_in_trace:
            raise ValueError(
                f"keras_ext: the model was built inside its first traced train step ({built_in_trace[:3]}), so "
                "their FP32 masters cannot be created from them; build the model before fit: give it a "
                "keras.Input (Sequential), call model.build(input_shape), or call it on one batch")
        with _outside_trace():
            for v in var_list:
                master = None
                if self.enabled and dtype_name(v) in LOW_PRECISION:
                    # Initialized from the variable's value at creation time (an
                    # assign here would be lost when Keras builds inside a trace).
                    master = optimizer.add_variable(shape=v.shape, dtype="float32", initializer=_CopyOf(v),
                                                    aggregation="none", name=f"{_label(v)}_master")
                self._masters.append(master)
        return [v if m is None else m for v, m in zip(var_list, self._masters)]

    def master_of(self, variable: Any, index: Callable[[Any], int]) -> Any:
        """The master of ``variable`` (None when it is its own); ``index`` is the optimizer's variable index."""
        return self._masters[index(variable)] if self.enabled else None

    def targets(self, grads: Sequence[Any], tvs: Sequence[Any],
                index: Callable[[Any], int]) -> tuple[list[Any], list[Any]]:
        """``(grads, targets)`` for the inner optimizer: a variable with a master is updated on the
        master, with its gradient widened to FP32."""
        masters = [self.master_of(v, index) for v in tvs]
        targets = [v if m is None else m for v, m in zip(tvs, masters)]
        grads = [g if g is None or t is v else ops.cast(g, "float32") for g, t, v in zip(grads, targets, tvs)]
        return list(grads), targets

    def write_back(self, tvs: Sequence[Any], index: Callable[[Any], int]) -> None:
        """Round the FP32 masters into the low-precision variables."""
        if not self.enabled:
            return
        for v in tvs:
            master = self.master_of(v, index)
            if master is not None:
                v.assign(ops.cast(master, v.dtype))


class _CopyOf(keras.initializers.Initializer):
    """Initializer: the current value of another variable, cast (not serialized)."""

    def __init__(self, source: Any) -> None:
        self.source = source

    def __call__(self, shape: Any, dtype: Any = None) -> Any:
        if is_tf():
            import tensorflow as tf

            with tf.init_scope():  # an eager value, so that TF can lift the creation out of a trace/XLA
                return self._read(dtype)
        return self._read(dtype)

    def _read(self, dtype: Any) -> Any:
        value = ops.convert_to_tensor(self.source.value if hasattr(self.source, "value") else self.source)
        fp32 = self.source.__dict__.pop(FP32_SOURCE, None) if hasattr(self.source, "__dict__") else None
        if fp32 is not None and fp32.shape == tuple(value.shape):
            exact = ops.convert_to_tensor(fp32, "float32")
            try:
                same = bool(ops.convert_to_numpy(ops.all(ops.equal(ops.cast(exact, value.dtype), value))))
            except Exception:  # a traced value (no host read): the variable's own value
                same = False
            if same:  # the variable still holds its rounding
                return ops.cast(exact, dtype or "float32")
        return ops.cast(value, dtype or "float32")


def _outside_trace() -> Any:
    """TF: ``tf.init_scope()``: the masters are created eagerly even when Keras builds the optimizer
    inside the traced first step (a master created in the trace from an eager initial value leaves
    that FP32 value captured by the traced function: 4 B/param held for the run)."""
    if not is_tf():
        return contextlib.nullcontext()
    import tensorflow as tf

    return tf.init_scope()


def _created_in_trace(v: Any) -> bool:
    """TF: a variable created inside a ``tf.function`` (a model without a known input shape that Keras builds
    in its first traced step): its initial value exists only in that trace."""
    return is_tf() and type(getattr(v, "value", v)).__name__ == "UnliftedInitializerVariable"


def _label(v: Any) -> str:
    label = getattr(v, "path", None) or getattr(v, "name", "var")
    return str(label).replace("/", "_").replace(":", "_")
