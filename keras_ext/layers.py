"""Walking a Keras model's layers: the one traversal every keras_ext module uses.

* :func:`walk`: ``(dotted path, layer)`` of every layer below ``layer``, depth first, in the
  order Keras tracks them (nested models and layers that hold sublayers included);
* :func:`policy_layers`: the layers a dtype policy applies to (no nested models, no inputs);
* :func:`own_variables`: the variables a layer holds itself (not those of its sublayers);
* :func:`is_container`: a nested model (its layers carry the policies, not the model).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import keras

__all__ = ["is_container", "own_variables", "policy_layers", "walk"]


def walk(layer: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """``(path, child)`` for every layer below ``layer``; a path joins layer names with dots."""
    for child in layer._flatten_layers(include_self=False, recursive=False):
        path = f"{prefix}.{child.name}" if prefix else child.name
        yield path, child
        yield from walk(child, path)


def is_container(layer: Any) -> bool:
    """True for a nested model: its layers carry the dtype policies, not the model itself."""
    return isinstance(layer, keras.Model)


def policy_layers(model: Any) -> Iterator[tuple[str, Any]]:
    """``(path, layer)`` of every layer a dtype policy applies to (no nested models, no inputs)."""
    return ((p, layer) for p, layer in walk(model)
            if not is_container(layer) and not isinstance(layer, keras.layers.InputLayer))


def own_variables(layer: Any) -> list[Any]:
    """The trainable then non-trainable variables ``layer`` holds itself (its sublayers' excluded)."""
    return list(getattr(layer, "_trainable_variables", [])) + list(getattr(layer, "_non_trainable_variables", []))
