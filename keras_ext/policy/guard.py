"""A model's ``compile`` under a recipe: an optimizer that cannot honour the recipe is wrapped, or refused.

:func:`keras_ext.apply_policy` (and :func:`keras_ext.load_model`) install :func:`guard_compile` on the
model: ``model.compile(optimizer=...)`` then checks the optimizer against the recipe.

* A plain Keras optimizer (or Keras' own ``LossScaleOptimizer``) under a recipe that needs more than
  it does (FP32 masters: ``*-master``, ``fp8-mixed``; update rounding: ``bf16-kahan``/``bf16-sr``;
  loss scaling: ``16-*``) is wrapped: ``keras_ext.master_optimizer(inner, recipe)``, with a warning that
  says so (pass that optimizer yourself to silence it).  Under ``32-true`` and ``bf16-mixed`` a plain
  optimizer does what the recipe asks and is left alone.
* A :class:`keras_ext.LossScaleOptimizer` without what the recipe needs (no masters under ``bf16-master``)
  is a :class:`~mp_callbacks.policy.PolicyError` that names the fix.
* A model compiled *before* ``apply_policy`` (or given its optimizer any other way than through the guarded
  ``compile``) keeps that optimizer: when it lacks what the recipe needs, the first ``fit`` or
  ``train_on_batch`` warns, once per optimizer, with the fix (compile again after ``apply_policy``; compiling
  again then is what the warning asks, so ``apply_policy`` itself says nothing).

After compiling with a :class:`keras_ext.LossScaleOptimizer` it installs
:func:`keras_ext.restore_on_skip` (BatchNorm statistics survive a skipped step); before
``fit`` / ``train_on_batch`` the optimizer's divergence rule watches the train function ahead of its
first trace, so the step returns the rule's latch instead of a variable read after each step.

The optimizer itself checks at build what no guard sees (:func:`keras_ext.weights.check_variables`):
low-precision variables it neither masters nor rounds, and a master recipe over a model stored in FP32
(warned, with counts).
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

import keras

from mp_callbacks.policy import PolicyError
from mp_callbacks.recipes import Recipe

from ..loss_scale import restore_on_skip
from ..optimizer import LossScaleOptimizer, master_optimizer

__all__ = ["check_compiled", "guard_compile", "lacking", "recipe_optimizer"]

_GUARDED = "_mp_compile_recipe"
_WARNED = "_mp_warned_optimizer"  # id of the compiled optimizer check_compiled warned about


def _rounds(recipe: Recipe) -> bool:
    return recipe.master.update_rounding not in (None, "none", "nearest")


def _needs(recipe: Recipe) -> list[str]:
    """What ``recipe`` asks of the optimizer beyond a plain Keras optimizer."""
    needs = []
    if recipe.master.master_weights:
        needs.append("FP32 master weights")
    if _rounds(recipe):
        needs.append(f"{recipe.master.update_rounding} update rounding")
    if recipe.scaler.enabled:
        needs.append("dynamic loss scaling")
    return needs


def _missing(optimizer: LossScaleOptimizer, recipe: Recipe) -> list[str]:
    """What ``recipe`` needs that a :class:`keras_ext.LossScaleOptimizer` does not do."""
    missing = []
    if recipe.master.master_weights and not optimizer.master_weights:
        missing.append("FP32 master weights")
    if _rounds(recipe) and optimizer.update_rounding is None:
        missing.append("update rounding")
    return missing


def lacking(optimizer: Any, recipe: Recipe) -> list[str]:
    """What ``recipe`` needs that ``optimizer`` (a compiled model's) does not do; ``[]``: nothing."""
    if optimizer is None:
        return []
    if isinstance(optimizer, LossScaleOptimizer):
        return _missing(optimizer, recipe)
    return _needs(recipe)


def recipe_optimizer(optimizer: Any, recipe: Recipe) -> Any:
    """``optimizer`` if it can honour ``recipe``, else ``master_optimizer(inner, recipe)`` (warned); a
    :class:`keras_ext.LossScaleOptimizer` lacking what the recipe needs raises :class:`PolicyError`."""
    needs = _needs(recipe)
    if isinstance(optimizer, LossScaleOptimizer):
        missing = _missing(optimizer, recipe)
        if missing:
            raise PolicyError(
                f"the model is set up for recipe {recipe.name!r}, which needs {', '.join(missing)}; its "
                f"keras_ext.LossScaleOptimizer implements {optimizer.recipe.name!r}: compile with "
                f"keras_ext.master_optimizer({type(optimizer.inner_optimizer).__name__}(...), {recipe.name!r})")
        return optimizer
    if not needs or optimizer is None:
        return optimizer
    inner = optimizer.inner_optimizer if isinstance(optimizer, keras.optimizers.LossScaleOptimizer) else optimizer
    if isinstance(inner, str):
        inner = keras.optimizers.get(inner)
    wrapped = master_optimizer(inner, recipe)
    warnings.warn(f"keras_ext: recipe {recipe.name!r} needs {', '.join(needs)}, which "
                  f"{type(optimizer).__name__} does not do; compiling with keras_ext.master_optimizer("
                  f"{type(inner).__name__}, {recipe.name!r}) instead (pass that optimizer to compile() to silence "
                  "this warning)", UserWarning, stacklevel=4)
    return wrapped


def check_compiled(model: Any, recipe: Recipe, stacklevel: int = 3) -> None:
    """Warn (once per optimizer) when ``model`` was compiled with an optimizer lacking what ``recipe`` needs."""
    optimizer = getattr(model, "optimizer", None)
    missing = lacking(optimizer, recipe)
    if not missing or model.__dict__.get(_WARNED) == id(optimizer):
        return
    object.__setattr__(model, _WARNED, id(optimizer))
    inner = optimizer.inner_optimizer if isinstance(optimizer, keras.optimizers.LossScaleOptimizer) else optimizer
    inner_name = type(inner).__name__
    warnings.warn(
        f"keras_ext: the model is set up for recipe {recipe.name!r}, which needs {', '.join(missing)}, but it was "
        f"compiled with {type(optimizer).__name__}, which does not do them (it was compiled before "
        f"keras_ext.apply_policy): it trains the low-precision weights directly and loses the updates they "
        f"cannot hold. Compile again after apply_policy: model.compile(keras_ext.master_optimizer("
        f"{inner_name}(...), {recipe.name!r}), ...) (a plain optimizer given to compile() then is wrapped)",
        UserWarning, stacklevel=stacklevel)


_TRAINING = ("fit", "train_on_batch")
"""The ``Model`` methods that apply the compiled optimizer, and so check it first (:func:`check_compiled`)."""


def _checked(model: Any, train: Any) -> Any:
    """``train`` (a bound ``fit`` / ``train_on_batch``) after :func:`check_compiled` for the guarded recipe; with
    a :class:`keras_ext.LossScaleOptimizer`, its divergence rule watches the train function before it is traced
    (:meth:`keras_ext.loss_scale.divergence.KerasDivergence.prepare`: the step returns the latch)."""

    @functools.wraps(train)
    def checked(*args: Any, **kwargs: Any) -> Any:
        current = model.__dict__.get(_GUARDED)
        if current is not None:
            check_compiled(model, current)
        optimizer = getattr(model, "optimizer", None)
        if isinstance(optimizer, LossScaleOptimizer):
            optimizer._divergence.prepare(model)  # the step returns the divergence latch (no variable read)
        return train(*args, **kwargs)

    return checked


def guard_compile(model: Any, recipe: Recipe | None) -> Any:
    """From now on ``model.compile`` passes its optimizer through :func:`recipe_optimizer` for ``recipe``
    (None: no guard; installing again replaces the recipe), and ``model.fit`` / ``model.train_on_batch``
    warn once per optimizer, whichever runs first (:func:`check_compiled`), when the model is already compiled
    with an optimizer that cannot honour it."""
    if recipe is None:
        model.__dict__.pop(_GUARDED, None)
        return model
    first = _GUARDED not in model.__dict__
    object.__setattr__(model, _GUARDED, recipe)
    if first:
        for name in _TRAINING:
            object.__setattr__(model, name, _checked(model, getattr(model, name)))
        compile_fn = model.compile

        @functools.wraps(compile_fn)
        def compile(*args: Any, **kwargs: Any) -> Any:
            current = model.__dict__.get(_GUARDED)
            if current is not None:
                if args:
                    args = (recipe_optimizer(args[0], current), *args[1:])
                else:
                    kwargs["optimizer"] = recipe_optimizer(kwargs.get("optimizer", "rmsprop"), current)
            result = compile_fn(*args, **kwargs)
            if isinstance(getattr(model, "optimizer", None), LossScaleOptimizer):
                restore_on_skip(model)  # a skipped step leaves BatchNorm's statistics as they were
            return result

        object.__setattr__(model, "compile", compile)
    return model
