"""A skipped step leaves the state the forward pass wrote as it was: BatchNorm's moving statistics.

The optimizer skips a step whose gradients are not finite, so weights, masters and slots stay clean; but
``BatchNormalization`` updated its moving mean and variance in the forward pass of that step already, from the
inf/NaN batch.  :func:`restore_on_skip` wraps ``model.train_step`` (on this model instance): before the step it
copies the model's non-trainable floating variables (:func:`forward_state`); after it, when the inner
optimizer's step count did not move (the step was skipped), it assigns them back inside a ``cond`` that writes
only on skipped steps.  A skipped step then leaves them equal to a run that never saw the batch.  On JAX the
trainer's ``train_step(state, data)`` is functional: the wrap compares the inner optimizer's step count in the
state it was given and the state it returns, and where it did not move returns the given values of those
variables (``where``, no host read).

:func:`keras_ext.apply_policy` / :func:`keras_ext.load_model` install it when the model is compiled with a
:class:`keras_ext.LossScaleOptimizer` (the compile guard, :mod:`keras_ext.policy.guard`)."""

from __future__ import annotations

from typing import Any

import keras
from keras import ops

from ..ops import is_jax, run_if, tree_where

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
    (``enabled=False`` removes the wrap); returns whether it is installed (False without such state).
    Takes effect when Keras next builds the train function (``compile`` resets it)."""
    if _ORIGINAL in model.__dict__:
        before = model.__dict__.pop(_ORIGINAL)
        if before is None:
            model.__dict__.pop("train_step", None)
        else:
            object.__setattr__(model, "train_step", before)
    if not enabled or not forward_state(model):
        return False
    original = model.__dict__.get("train_step")
    step = model.train_step
    if is_jax():
        return _install(model, original, _stateless_train_step(model, step))

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

    return _install(model, original, train_step)


def _install(model: Any, original: Any, train_step: Any) -> bool:
    object.__setattr__(model, _ORIGINAL, original)
    object.__setattr__(model, "train_step", train_step)
    model.train_function = None
    return True


def _stateless_train_step(model: Any, step: Any) -> Any:
    """JAX: ``train_step(state, data) -> (logs, state)``; state = (trainable, non-trainable, optimizer,
    metrics) values in the order of the model's and the optimizer's variable lists."""

    def train_step(state: Any, data: Any) -> Any:
        logs, new_state = step(state, data)
        applied = _iterations(model)
        where = [i for i, v in enumerate(model.optimizer.variables) if v is applied]
        if not where:
            return logs, new_state
        skipped = ops.equal(new_state[2][where[0]], state[2][where[0]])
        restored = {id(v) for v in forward_state(model)}
        non_trainable = [tree_where(skipped, old, new) if id(v) in restored else new
                         for v, old, new in zip(model.non_trainable_variables, state[1], new_state[1])]
        return logs, (new_state[0], non_trainable, *new_state[2:])

    return train_step
