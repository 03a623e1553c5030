"""Rebuilding a model whose built variables must change dtype (Keras cannot change a variable's dtype).

A Sequential or Functional model is cloned layer by layer; a graph model with a constructor of its own
(a keras_hub backbone: it builds every layer itself from its ``dtype``) is built again from its config
with a :class:`~keras_ext.policy.maps.PolicyMap` as ``dtype``, which keeps its class; so is a layer
that builds its sublayers (its config carries the map).  The weights are then copied, cast; the FP32
value of each variable stored in low precision is kept on it (:data:`FP32_SOURCE`) for the FP32
master the optimizer creates (:mod:`keras_ext.weights.masters`): masters start from the same values as an
FP32 run, not from their rounding.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import keras
import numpy as np
from keras import ops

from mp_callbacks.policy import PolicyError

from ..layers import children, is_graph, loading_scope, own_variables, walk
from ..weights import FP32_SOURCE
from .maps import PolicyMap

__all__ = ["clone_with_policies", "copy_weights", "has_own_constructor", "is_clonable",
           "rebuilt"]

def is_clonable(model: Any) -> bool:
    """True for the models Keras can clone layer by layer (Sequential, Functional) or build again from their
    config (a graph model with a constructor of its own)."""
    return is_graph(model)


def has_own_constructor(model: Any) -> bool:
    """A graph model whose config is its constructor's arguments (a keras_hub backbone), not its layers'."""
    from keras.src.models.functional import Functional

    return is_graph(model) and type(model) not in (Functional, keras.Sequential) and \
        type(model).get_config is not Functional.get_config


def _map_for(layer: Any, by_id: Mapping[int, Any]) -> PolicyMap:
    """A map with ``by_id``'s policies for ``layer``'s sublayers, ``layer``'s as default.  A sublayer is found
    by its Keras path (set where it was first built) and by the path it gets when built inside ``layer``: a
    sublayer the graph called before its owner (a tied embedding) may be built at the other one in the copy."""
    entries: dict[str, Any] = {}
    for rel, sub in walk(layer):
        if id(sub) in by_id:
            for key in (sub.path, "/".join([layer.path or layer.name, *rel.split(".")])):
                if key:
                    entries.setdefault(key, by_id[id(sub)])
    return PolicyMap(by_id.get(id(layer), layer.dtype_policy), entries)


def _from_config(layer: Any, dtype: Any) -> Any:
    try:
        config = layer.get_config()
    except Exception as exc:
        raise PolicyError(f"keras_ext cannot rebuild {layer.name!r} ({type(layer).__name__}) with new variable "
                          f"dtypes: its get_config() fails ({type(exc).__name__}: {exc}); build the model under the "
                          "recipe's policy (keras_ext.set_global_policy before building), or rebuild the model "
                          "that holds it from its own config") from exc
    config["dtype"] = dtype
    return layer.__class__.from_config(config)


def clone_with_policies(model: keras.Model, by_id: Mapping[int, Any], default: Any) -> keras.Model:
    """A copy of a graph ``model`` whose layers get ``by_id[id(layer)]`` as dtype policy (layers not in it keep
    theirs; ``default``: Keras' global policy while building); weights not copied.  A layer shared between a
    layer built again from its config and the graph (a tied LM head: the graph calls the backbone's token
    embedding) stays shared: the graph gets the rebuilt owner's sublayer, not a second copy."""
    with _keras_policy(default), loading_scope():
        return _clone(model, by_id, {})


def _clone(model: keras.Model, by_id: Mapping[int, Any], done: dict[int, Any]) -> keras.Model:
    """:func:`clone_with_policies` with ``done``: the clone of each layer cloned so far, by the original's id."""

    def rebuild(layer: Any, dtype: Any) -> Any:
        new = _from_config(layer, dtype)
        for (_, old_sub), (_, new_sub) in zip(walk(layer), walk(new)):
            done.setdefault(id(old_sub), new_sub)
        return new

    def clone_layer(layer: Any) -> Any:
        if id(layer) in done:
            return done[id(layer)]
        if not isinstance(layer, keras.layers.Layer):  # an op of the graph (``x * y`` of KerasTensors)
            new = layer.__class__.from_config(layer.get_config())
        elif isinstance(layer, keras.Model) and not has_own_constructor(layer):
            new = _clone(layer, by_id, done)
        elif isinstance(layer, keras.Model) or list(walk(layer)):
            new = rebuild(layer, _map_for(layer, by_id))
        else:
            new = _from_config(layer, by_id.get(id(layer), layer.dtype_policy))
        done[id(layer)] = new
        return new

    if has_own_constructor(model):
        return rebuild(model, _map_for(model, by_id))
    for child in children(model):  # owners first: the graph may call one of their sublayers before them
        if has_own_constructor(child) or (not is_graph(child) and list(walk(child))):
            clone_layer(child)
    return keras.models.clone_model(model, clone_function=clone_layer, recursive=False)


def copy_weights(source: keras.Model, target: keras.Model, keep_fp32: bool) -> None:
    """``target``'s weights := ``source``'s, cast; ``keep_fp32``: a variable rounded from FP32 keeps the FP32
    value (:data:`FP32_SOURCE`)."""
    if len(source.weights) != len(target.weights):
        raise PolicyError(f"the rebuilt model has {len(target.weights)} weights, the model {len(source.weights)}")
    for old, new in zip(source.weights, target.weights):
        new.assign(ops.cast(old, new.dtype))
        if keep_fp32 and _dtype(old) == "float32" and _dtype(new) in ("float16", "bfloat16"):
            setattr(new, FP32_SOURCE, np.array(ops.convert_to_numpy(old)))


def rebuilt(model: keras.Model, by_id: Mapping[int, Any], default: Any, keep_fp32: bool) -> keras.Model:
    """``model`` built again with ``by_id``'s policies and its weights (see the module docstring); a layer that
    comes back with other variable dtypes than its policy's is a :class:`PolicyError` naming it."""
    clone = clone_with_policies(model, by_id, default)
    pairs = list(zip((x for _, x in walk(model)), (x for _, x in walk(clone))))
    wrong = []
    for old, new in pairs:
        if type(old) is not type(new):
            raise PolicyError(f"rebuilding {type(model).__name__}: {old.name!r} came back as {type(new).__name__}")
        if id(old) in by_id and not isinstance(new, keras.Model):
            new.dtype_policy = by_id[id(old)]
            want = keras.backend.standardize_dtype(new.variable_dtype)
            wrong += [f"{v.path} ({_dtype(v)}, wanted {want})" for v in own_variables(new)
                      if keras.backend.is_float_dtype(_dtype(v)) and _dtype(v) != want]
    if wrong:
        raise PolicyError(f"rebuilding {type(model).__name__}, these variables came back in other dtypes than "
                          f"their layers' policies: {wrong}; the layer holding them does not build them from its "
                          "own dtype policy")
    copy_weights(model, clone, keep_fp32)
    return clone


def _dtype(v: Any) -> str:
    return keras.backend.standardize_dtype(v.dtype)


class _keras_policy:
    """Keras' global dtype policy ``kp`` within the block."""

    def __init__(self, kp: Any) -> None:
        self.kp = kp

    def __enter__(self) -> None:
        self.before = keras.config.dtype_policy()
        keras.config.set_dtype_policy(self.kp)

    def __exit__(self, *exc: Any) -> None:
        keras.config.set_dtype_policy(self.before)
