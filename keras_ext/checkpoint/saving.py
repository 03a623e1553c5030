"""Saving a run: the FP32 masters as the saved weights, and FP32 exports.

Keras' own ``model.save`` stores every variable in its dtype: a ``*-master`` model's bfloat16/float16 variables,
while the FP32 masters travel with the optimizer's variables.  Here:

* :func:`save_model` / :func:`save_weights`: ``model.save`` / ``model.save_weights`` with the FP32 master written
  in place of each low-precision variable that has one (the layer's own ``save_own_variables`` runs; its store
  receives the master).  An FP32 copy of the model loads the masters exactly (``fp32_model.load_weights(path)``);
  loading under the same recipe rounds them into the same low-precision values and restores the masters from
  the optimizer's variables: the run resumes bit for bit.
* :func:`export_fp32`: an FP32 copy of a Sequential or Functional model holding the FP32 values (masters where
  kept); with a path it is saved, so that ``keras.models.load_model(path)`` gives that FP32 model.
* :func:`fp32_values`: the model's weights as float32 arrays (masters where kept).
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

from mp_callbacks.policy import PolicyError

from ..layers import policy_layers, walk
from ..optimizer import LossScaleOptimizer
from ..policy import clone_with_policies, is_clonable

__all__ = ["export_fp32", "fp32_values", "masters_of", "save_model", "save_weights"]


def masters_of(model: keras.Model, optimizer: Any = None) -> dict[int, Any]:
    """``id(variable) -> FP32 master`` for the model's variables that have one (empty without masters)."""
    opt = optimizer if optimizer is not None else getattr(model, "optimizer", None)
    if not isinstance(opt, LossScaleOptimizer) or not opt.master_weights or not opt.built:
        return {}
    pairs = ((v, opt.master_variables[opt._get_variable_index(v)]) for v in model.trainable_variables)
    return {id(v): m for v, m in pairs if m is not None}


def fp32_values(model: keras.Model, optimizer: Any = None) -> list[np.ndarray]:
    """``model.weights`` as float32 arrays: the FP32 master where the optimizer (default: the model's)
    keeps one, else the variable's value."""
    masters = masters_of(model, optimizer)
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
    masters = masters_of(model)
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
