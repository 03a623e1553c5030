"""Resuming a saved run, also under another recipe or from Keras' own optimizers: :func:`resume`.

The core decides what carries over (:func:`~mp_callbacks.recipes.plan_resume`).  The same recipe restores
everything; another recipe (opt-in: ``allow_recipe_change=True``; otherwise a
:class:`~mp_callbacks.settings.StateDictError` names both) takes the weights from the FP32 values (the masters of
a ``*-master`` run), builds this optimizer's masters from them, carries the inner optimizer's slots, step count
and learning rate over, and restarts the loss scaler from its config with a warning.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import keras
from keras import ops

from mp_callbacks.loss_scale import check_state_dict
from mp_callbacks.recipes import ResumePlan, get_recipe, plan_resume
from mp_callbacks.settings import StateDictError

from ..global_policy import RECIPE_OF_DTYPES, optimizer_recipe
from ..layers import policy_layers, resolved_policy
from ..optimizer import LossScaleOptimizer
from .loading import load_model
from .saving import fp32_values, masters_of

__all__ = ["resume"]


def _layer_recipe(saved: keras.Model) -> str:
    """The recipe of the saved layers' dtypes (``mixed_float16`` -> ``16-mixed``, ``bfloat16`` -> ``bf16-master``)."""
    low = [(p.variable_dtype, p.compute_dtype) for p in (resolved_policy(layer) for _, layer in policy_layers(saved))
           if p.compute_dtype != "float32"]
    return RECIPE_OF_DTYPES.get(low[0], "32-true") if low else "32-true"


def _saved_recipe(saved: keras.Model, opt: LossScaleOptimizer) -> str:
    """The recipe a saved run used: the one its optimizer was given, else the one of its layers' dtypes."""
    if opt._recipe_given is not None:
        return opt.recipe.name
    return optimizer_recipe(get_recipe(_layer_recipe(saved)), opt.scaler_config, opt.master_weights).name


def _inner(opt: Any) -> Any:
    """The optimizer holding the slots: a loss-scale optimizer's inner one (Keras' or ours), else ``opt``."""
    return opt.inner_optimizer if isinstance(opt, keras.optimizers.LossScaleOptimizer) else opt


def _shapes(variables: Any) -> list[tuple[int, ...]]:
    return [tuple(v.shape) for v in variables]


def _check_same_run(saved: keras.Model, saved_opt: Any, model: keras.Model, opt: LossScaleOptimizer) -> None:
    if _shapes(saved.weights) != _shapes(model.weights):
        raise StateDictError(f"the saved model's weights have shapes {_shapes(saved.weights)}; this model's "
                             f"{_shapes(model.weights)}")
    a, b = _inner(saved_opt), opt.inner_optimizer
    if type(a) is not type(b) or _shapes(a.variables) != _shapes(b.variables):
        raise StateDictError(f"the saved run's optimizer is a {type(a).__name__} with {len(a.variables)} variables; "
                             f"this model's is a {type(b).__name__} with {len(b.variables)}")


def _native_plan(saved: keras.Model, saved_opt: Any, opt: LossScaleOptimizer, where: str,
                 allow_recipe_change: bool) -> ResumePlan:
    """A checkpoint of Keras' own optimizers (``keras.optimizers.LossScaleOptimizer``, or a plain one): always a
    recipe change (their scaler state is not keras_ext's); opt-in, like any other."""
    kind = type(saved_opt).__name__
    name = _layer_recipe(saved)
    if not allow_recipe_change:
        raise StateDictError(f"{where} was saved with Keras' own {kind} (layers: recipe {name!r}); this model uses "
                             f"keras_ext's recipe {opt.recipe.name!r}. Pass allow_recipe_change=True to continue under "
                             f"{opt.recipe.name!r}: weights, optimizer slots and step count carried over, the loss "
                             "scaler restarts from its config.")
    return ResumePlan(f"{name} (Keras {kind})", opt.recipe.name, False, False, False)


def resume(model: keras.Model, source: keras.Model | str | os.PathLike[str],
           allow_recipe_change: bool = False) -> ResumePlan:
    """Continue the run saved in ``source`` (a ``.keras`` path, or a loaded model) with ``model``, compiled
    with a :class:`keras_ext.LossScaleOptimizer` for the recipe to continue under; returns the
    :class:`~mp_callbacks.recipes.ResumePlan`.

    The same recipe: weights, masters, optimizer slots and step count, scaler state, exactly.  Another
    recipe, with ``allow_recipe_change=True`` (else :class:`~mp_callbacks.settings.StateDictError` naming
    both): the weights from the saved FP32 values (masters where the saved run kept them), this
    optimizer's masters from those values, the inner optimizer's variables (slots, step count, learning
    rate) carried over, the scaler restarted from its config (a warning says so).  A checkpoint of Keras'
    own optimizers (``keras.optimizers.LossScaleOptimizer`` or a plain optimizer) resumes the same way,
    opted in: its scaler state is Keras'.  The divergence streaks start at 0.  The model's architecture and
    the inner optimizer's class must be the saved ones; ``model``'s dtype policies are its own (apply the
    recipe's before).  A path is loaded with :func:`keras_ext.load_model` (a second copy of the model while
    resuming; a truncated or foreign file is a :class:`~keras_ext.checkpoint.loading.SavedFileError`).
    """
    opt = getattr(model, "optimizer", None)
    if not isinstance(opt, LossScaleOptimizer):
        raise TypeError(f"resume needs a model compiled with keras_ext.LossScaleOptimizer, not {type(opt).__name__}")
    saved = source if isinstance(source, keras.Model) else load_model(source)
    saved_opt = getattr(saved, "optimizer", None)
    where = "the given model" if isinstance(source, keras.Model) else os.fspath(source)
    if saved_opt is None or not saved_opt.built or not _inner(saved_opt).built:
        raise StateDictError(f"{where} holds no optimizer state (its optimizer: {type(saved_opt).__name__}, built: "
                             f"{getattr(saved_opt, 'built', False)}); this model uses recipe {opt.recipe.name!r}")
    if isinstance(saved_opt, LossScaleOptimizer):
        name = _saved_recipe(saved, saved_opt)
        plan = plan_resume(name, opt.recipe, allow_recipe_change,
                           f"keras_ext.load_model(path) continues it under {name!r}. ")
    else:
        plan = _native_plan(saved, saved_opt, opt, where, allow_recipe_change)
    if not opt.built:
        opt.build(model.trainable_variables)
    _check_same_run(saved, saved_opt, model, opt)
    if plan.load_scaler:  # a scaler config mismatch is an error before anything changes
        check_state_dict(opt.scaler_config, saved_opt.scaler_state_dict())
    masters = masters_of(model)
    for variable, value in zip(model.weights, fp32_values(saved), strict=True):
        variable.assign(ops.cast(value, variable.dtype))
        if id(variable) in masters:
            masters[id(variable)].assign(value)
    for mine, theirs in zip(opt.inner_optimizer.variables, _inner(saved_opt).variables, strict=True):
        mine.assign(ops.cast(theirs.value, mine.dtype))
    if plan.load_scaler:
        opt.load_scaler_state_dict(saved_opt.scaler_state_dict())
    else:
        opt.loss_scaler.reset()
        warnings.warn(f"keras_ext.resume: {plan.warning()}", stacklevel=2)
    return plan
