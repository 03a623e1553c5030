"""Checkpoints across recipes: FP32 masters as the saved weights, FP32 exports, resuming under another recipe.

The twin of :mod:`lightning_ext.checkpoint` (the plugin's ``on_save_checkpoint`` / ``load_state_dict``).
Keras' own ``model.save`` stores every variable in its dtype: a ``*-master``
model's bfloat16/float16 variables, while the FP32 masters travel with the
optimizer's variables.  This module adds what Keras cannot do by itself:

* :func:`save_model` / :func:`save_weights`: ``model.save`` / ``model.save_weights``
  with the FP32 master written in place of each low-precision variable that has
  one (the layer's own ``save_own_variables`` runs; its store receives the
  master).  An FP32 copy of the model loads the masters exactly
  (``fp32_model.load_weights(path)``); ``keras.models.load_model(path)`` under
  the same recipe rounds them into the same low-precision values and restores
  the masters from the optimizer's variables: the run resumes bit for bit.
* :func:`export_fp32`: an FP32 copy of a Sequential or Functional model holding
  the FP32 values (masters where kept); with a path it is saved, so that
  ``keras.models.load_model(path)`` gives that FP32 model.
* :func:`resume`: continue a saved run with this model and optimizer, under
  their recipe (the core's :func:`~mp_callbacks.recipes.plan_resume`).  The same
  recipe restores everything; another recipe (opt-in: ``allow_recipe_change=True``;
  otherwise a :class:`~mp_callbacks.loss_scale.scaler.StateDictError` names both) takes the
  weights from the FP32 values (the masters of a ``*-master`` run), builds this
  optimizer's masters from them, carries the inner optimizer's slots, step count
  and learning rate over, and restarts the loss scaler from its config with a warning.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import keras
import numpy as np
from keras import ops

from mp_callbacks.loss_scale import check_state_dict
from mp_callbacks.policy import PolicyError
from mp_callbacks.recipes import ResumePlan, get_recipe, plan_resume
from mp_callbacks.settings import StateDictError

from .global_policy import RECIPE_OF_DTYPES, optimizer_recipe
from .layers import policy_layers, resolved_policy, walk
from .loading import load_model
from .optimizer import LossScaleOptimizer
from .rebuild import clone_with_policies, is_clonable

__all__ = ["export_fp32", "fp32_values", "resume", "save_model", "save_weights"]


def _masters_of(model: keras.Model, optimizer: Any = None) -> dict[int, Any]:
    """``id(variable) -> FP32 master`` for the model's variables that have one (empty without masters)."""
    opt = optimizer if optimizer is not None else getattr(model, "optimizer", None)
    if not isinstance(opt, LossScaleOptimizer) or not opt.master_weights or not opt.built:
        return {}
    pairs = ((v, opt.master_variables[opt._get_variable_index(v)]) for v in model.trainable_variables)
    return {id(v): m for v, m in pairs if m is not None}


def fp32_values(model: keras.Model, optimizer: Any = None) -> list[np.ndarray]:
    """``model.weights`` as float32 arrays: the FP32 master where the optimizer (default: the model's)
    keeps one, else the variable's value."""
    masters = _masters_of(model, optimizer)
    return [np.asarray(ops.convert_to_numpy(masters[id(v)].value if id(v) in masters else ops.cast(v.value, "float32")),
                       dtype=np.float32) for v in model.weights]


# ------------------------------------------------------------------ saving
class _MasterStore:
    """A layer's weights store in which a variable with a master is written as its master."""

    def __init__(self, store: Any, masters: Mapping[int, Any], written: set[int]) -> None:
        self._store, self._masters, self._written = store, masters, written

    def __setitem__(self, key: str, value: Any) -> None:
        if id(value) in self._masters:
            self._written.add(id(value))
            value = self._masters[id(value)].value
        self._store[key] = value

    def __getitem__(self, key: str) -> Any:
        return self._store[key]

    def __len__(self) -> int:
        return len(self._store)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)


@contextlib.contextmanager
def _masters_as_weights(model: keras.Model) -> Iterator[None]:
    """Within the block, each layer holding a variable with a master saves the master; afterwards every layer
    has the ``save_own_variables`` it had (an FP8 layer keeps its own: its FP8 state is saved every time)."""
    masters = _masters_of(model)
    written: set[int] = set()
    patched = []
    try:
        for _, layer in walk(model):
            if any(id(v) in masters for v in getattr(layer, "_trainable_variables", [])):
                before = layer.__dict__.get("save_own_variables")  # an instance override (FP8), or None
                own = layer.save_own_variables
                object.__setattr__(layer, "save_own_variables",
                                   lambda store, own=own: own(_MasterStore(store, masters, written)))
                patched.append((layer, before))
        yield
    finally:
        for layer, before in patched:
            if before is None:
                object.__delattr__(layer, "save_own_variables")
            else:
                object.__setattr__(layer, "save_own_variables", before)
    missed = [v.path for v in model.trainable_variables if id(v) in masters and id(v) not in written]
    if missed:
        warnings.warn(f"keras_ext: {missed} were saved by their layers in their own dtype, not as their FP32 "
                      "masters (the masters are in the optimizer's variables)", stacklevel=3)


def save_model(model: keras.Model, filepath: str | os.PathLike[str], **kwargs: Any) -> None:
    """``model.save(filepath, **kwargs)`` with the FP32 masters as the stored values of the variables that have
    one (a ``*-master`` model; any other model is saved exactly as ``model.save`` saves it)."""
    with _masters_as_weights(model):
        model.save(filepath, **kwargs)


def save_weights(model: keras.Model, filepath: str | os.PathLike[str], **kwargs: Any) -> None:
    """``model.save_weights(filepath, **kwargs)`` with the FP32 masters as the stored values
    (see :func:`save_model`)."""
    with _masters_as_weights(model):
        model.save_weights(filepath, **kwargs)


def export_fp32(model: keras.Model, filepath: str | os.PathLike[str] | None = None, **kwargs: Any) -> keras.Model:
    """An FP32 copy of ``model`` (every layer ``float32``) holding :func:`fp32_values`, uncompiled; saved to
    ``filepath`` (``kwargs``: ``model.save``'s) when given.  Sequential and Functional models only (Keras
    clones those layer by layer); for a subclassed model build an FP32 instance and load
    :func:`save_weights` into it."""
    if not is_clonable(model):
        raise PolicyError("export_fp32 clones the model layer by layer, which Keras does for Sequential and "
                          f"Functional models only, not a {type(model).__name__}: build an FP32 instance of it "
                          "and load keras_ext.save_weights(model, path) into it")
    fp32 = keras.DTypePolicy("float32")
    clone = clone_with_policies(model, {id(layer): fp32 for _, layer in policy_layers(model)}, fp32)
    for variable, value in zip(clone.weights, fp32_values(model), strict=True):
        variable.assign(value)
    if filepath is not None:
        clone.save(filepath, **kwargs)
    return clone


# ----------------------------------------------------------------- resuming
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
    recipe, with ``allow_recipe_change=True`` (else :class:`~mp_callbacks.loss_scale.scaler.StateDictError` naming
    both): the weights from the saved FP32 values (masters where the saved run kept them), this
    optimizer's masters from those values, the inner optimizer's variables (slots, step count, learning
    rate) carried over, the scaler restarted from its config (a warning says so).  A checkpoint of Keras'
    own optimizers (``keras.optimizers.LossScaleOptimizer`` or a plain optimizer) resumes the same way,
    opted in: its scaler state is Keras'.  The divergence streaks start at 0.  The model's architecture and
    the inner optimizer's class must be the saved ones; ``model``'s dtype policies are its own (apply the
    recipe's before).  A path is loaded with :func:`keras_ext.load_model` (a second copy of the model while
    resuming; a truncated or foreign file is a :class:`~keras_ext.loading.SavedFileError`).
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
    masters = _masters_of(model)
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
