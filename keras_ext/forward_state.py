"""A skipped step leaves the state the forward pass wrote as it was: BatchNorm's moving statistics.

The optimizer skips a step whose gradients are not finite (:class:`keras_ext.LossScaleOptimizer`), so
weights, masters and slots stay clean; but ``BatchNormalization`` updated its moving mean and variance in
the forward pass of that step already, from the inf/NaN batch: the next eval would read them.

:func:`restore_on_skip` wraps ``model.train_step``: before the step it takes a snapshot (``ops.copy``) of the
model's non-trainable floating variables (moving statistics, and anything else the forward may write);
after it, when the inner optimizer's step count did not move (the step was skipped), it assigns them
back.  A skipped step then leaves them equal to a run that never saw the batch.  The cost per step: the
snapshot (TensorFlow shares the buffer until the forward writes the variable, so only the written ones,
the moving statistics, a few floats per channel, are copied) and a ``cond`` that writes only on skipped
steps (``benchmarks/bench_keras_bn_skip.py`` measures it).  TensorFlow and torch backends; on JAX the
forward's state is the trainer's returned state (not restored: a warning).

:func:`keras_ext.apply_policy` / :func:`keras_ext.load_model` install it when the model is compiled with
a :class:`keras_ext.LossScaleOptimizer` (the guard in :mod:`keras_ext.guard`).
"""

from __future__ import annotations

import warnings
from typing import Any

import keras
from keras import ops

from .jax_support import is_jax, run_if

__all__ = ["forward_state", "restore_on_skip"]

_ORIGINAL = "_mp_train_step"


def forward_state(model: Any) -> list[Any]:
    """The non-trainable floating variables of ``model`` (what its forward pass may write)."""
    return [v for v in model.non_trainable_variables
            if keras.backend.is_float_dtype(keras.backend.standardize_dtype(v.dtype))]


def _iterations(model: Any) -> Any:
    """The inner optimizer's step count (it exists before the optimizer is built; skipped steps leave it)."""
    opt = getattr(model, "optimizer", None)
    inner = getattr(opt, "inner_optimizer", None)
    return getattr(inner, "_iterations", None) if inner is not None else None


def restore_on_skip(model: Any, enabled: bool = True) -> bool:
    """Wrap ``model.train_step`` so that a step the optimizer skips leaves :func:`forward_state` as it was
    (``enabled=False`` removes the wrap); returns whether it is installed (False without such state or on
    JAX).  Takes effect when Keras next builds the train function (``compile`` resets it)."""
    if _ORIGINAL in model.__dict__:
        before = model.__dict__.pop(_ORIGINAL)
        if before is None:
            model.__dict__.pop("train_step", None)
        else:
            object.__setattr__(model, "train_step", before)
    if not enabled or not forward_state(model):
        return False
    if is_jax():
        warnings.warn("keras_ext.restore_on_skip: on JAX the forward's state (BatchNorm statistics) is the "
                      "trainer's returned state and is not restored on a skipped step", UserWarning, stacklevel=2)
        return False
    original = model.__dict__.get("train_step")
    step = model.train_step

    def train_step(data: Any) -> Any:
        state = forward_state(model)
        applied = _iterations(model)  # a skipped step leaves the inner optimizer's count where it was
        before = [ops.copy(v.value) for v in state]  # copies: a plain read may alias what the forward writes
        applied_before = ops.copy(applied.value) if applied is not None else None
        logs = step(data)
        if applied is None:
            return logs

        def restore() -> None:
            for v, value in zip(state, before):
                v.assign(value)

        run_if(ops.equal(ops.convert_to_tensor(applied.value), applied_before), restore, state)
        return logs

    object.__setattr__(model, _ORIGINAL, original)
    object.__setattr__(model, "train_step", train_step)
    model.train_function = None
    return True
