"""Walking a Keras model's layers: the one traversal every keras_ext module uses.

* :func:`walk`: ``(dotted path, layer)`` of every layer below ``layer``, depth first, in the
  order Keras tracks them (nested models and layers that hold sublayers included);
* :func:`walk_tree`: the same with each layer's *composite* parent (the layer whose ``call``
  runs it, or None when a graph model connects it);
* :func:`policy_layers`: the layers a dtype policy applies to (no nested models, no inputs);
* :func:`own_variables`: the variables a layer holds itself (not those of its sublayers);
* :func:`is_container`: a nested model (its layers carry the policies, not the model itself);
* :func:`is_graph`: a Functional or Sequential model (its layers are connected by their calls);
* :func:`resolved_policy`: a layer's own dtype policy (its entry when it holds a ``DTypePolicyMap``);
* :func:`loading_scope` / :func:`loading_permitted`: keras_ext is deserializing (its registered policies, which
  only its loaders can complete, refuse to load otherwise).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import keras

__all__ = ["HOW_TO_LOAD", "children", "is_container", "is_graph", "loading_permitted", "loading_scope", "own_variables",
           "policy_layers", "resolved_policy", "walk", "walk_tree"]

HOW_TO_LOAD = ("load it with keras_ext.load_model(path) (keras_ext installs the casts between FP32 regions and "
               "low-precision layers and the FP8 matmuls, which Keras cannot rebuild)")
"""What a refused load says to do."""


def children(layer: Any) -> list[Any]:
    """The layers ``layer`` tracks directly (input layers excluded)."""
    return [c for c in layer._flatten_layers(include_self=False, recursive=False)
            if not isinstance(c, keras.layers.InputLayer)]


def walk(layer: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """``(path, child)`` for every layer below ``layer``; a path joins layer names with dots."""
    for child in layer._flatten_layers(include_self=False, recursive=False):
        path = f"{prefix}.{child.name}" if prefix else child.name
        yield path, child
        yield from walk(child, path)


def is_container(layer: Any) -> bool:
    """True for a nested model: its layers carry the dtype policies, not the model itself."""
    return isinstance(layer, keras.Model)


def is_graph(layer: Any) -> bool:
    """True for a Functional or Sequential model (subclasses such as keras_hub backbones included): its
    layers meet through their own calls, which cast their inputs; a subclassed model's ``call`` does not."""
    if isinstance(layer, keras.Sequential):
        return True
    try:
        from keras.src.models.functional import Functional
    except Exception:  # pragma: no cover - other Keras layouts
        return type(layer).__name__ == "Functional"
    return isinstance(layer, Functional)


def walk_tree(model: Any, prefix: str = "", parent: Any = None) -> Iterator[tuple[str, Any, Any]]:
    """``(path, layer, composite parent)`` for every layer below ``model`` (input layers excluded); the
    parent is the nearest enclosing layer that is not a graph model (``model`` itself when it is a
    subclassed model), None for a layer that a graph model connects."""
    here = parent if is_graph(model) else model
    for child in children(model):
        path = f"{prefix}.{child.name}" if prefix else child.name
        yield path, child, here
        yield from walk_tree(child, path, here)


def policy_layers(model: Any) -> Iterator[tuple[str, Any]]:
    """``(path, layer)`` of every layer a dtype policy applies to (no nested models, no inputs)."""
    return ((p, layer) for p, layer in walk(model)
            if not is_container(layer) and not isinstance(layer, keras.layers.InputLayer))


def own_variables(layer: Any) -> list[Any]:
    """The trainable then non-trainable variables ``layer`` holds itself (its sublayers' excluded)."""
    return list(getattr(layer, "_trainable_variables", [])) + list(getattr(layer, "_non_trainable_variables", []))


def resolved_policy(layer: Any) -> Any:
    """The dtype policy ``layer`` computes with: its own, or its entry in the ``DTypePolicyMap`` it holds."""
    policy = layer.dtype_policy
    if isinstance(policy, keras.dtype_policies.DTypePolicyMap) and layer.path:
        return policy[layer.path]
    if isinstance(policy, keras.dtype_policies.DTypePolicyMap):
        return policy.default_policy
    return policy


_LOADING = "keras_ext_loading"  # Keras' global_state attribute: keras_ext is deserializing


def loading_permitted() -> bool:
    """True within :func:`loading_scope`."""
    from keras.src.backend.common import global_state

    return bool(global_state.get_global_attribute(_LOADING, False))


@contextlib.contextmanager
def loading_scope() -> Iterator[None]:
    """Within the block Keras deserializes keras_ext's registered policies (``PolicyMap``, ``FP8Policy``: keras_ext's
    loaders and clones use it; the flag lives in Keras' own thread-local global state, not in this module)."""
    from keras.src.backend.common import global_state

    before = global_state.get_global_attribute(_LOADING, False)
    global_state.set_global_attribute(_LOADING, True)
    try:
        yield
    finally:
        global_state.set_global_attribute(_LOADING, before)
