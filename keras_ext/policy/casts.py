"""The casts where a layer's compute dtype meets its composite's (:func:`mp_callbacks.policy.boundary_cast`).

A layer's own ``call`` casts its inputs to its compute dtype (Keras does that); inside a composite's
``call`` the tensors meet in raw ops (``x + residual``, the attention einsum), so a sublayer that
computes in another dtype than its composite hands its floating outputs back in the composite's dtype:
an FP32 ``LayerNormalization`` inside a bf16 ``TransformerEncoder`` returns bf16, a bf16 ``Dense``
inside an FP32 block returns FP32.  A composite producing a model output casts its outputs to
``output=`` (:data:`~keras_ext.policy.maps.MODEL_OUTPUT`, saved in its owner's map).

:func:`install_casts` derives the casts from the layers' current policies, so it gives the same
result after :func:`keras_ext.apply_policy` and after :func:`keras_ext.load_model`; installing again
replaces the previous casts.  The cast wraps the layer's ``call`` (an instance attribute, like the
FP8 call of :mod:`keras_ext.fp8`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import keras
from keras import ops

from mp_callbacks.policy import boundary_cast

from ..layers import resolved_policy, walk_tree
from .maps import MODEL_OUTPUT

__all__ = ["cast_of", "install_casts", "set_output_cast"]

_ORIGINAL = "_mp_uncast_call"  # the call before the cast (None: the class's own)
_TARGET = "_mp_cast_outputs_to"


def compute_dtype(layer: Any) -> str:
    """The dtype ``layer`` computes in (through the ``DTypePolicyMap`` it may hold)."""
    return keras.backend.standardize_dtype(resolved_policy(layer).compute_dtype)


def cast_of(layer: Any) -> str | None:
    """The dtype :func:`install_casts` casts ``layer``'s outputs to (None: no cast)."""
    return layer.__dict__.get(_TARGET)


def _cast(value: Any, dtype: str) -> Any:
    if value is None or not hasattr(value, "dtype") or not hasattr(value, "shape"):
        return value
    current = keras.backend.standardize_dtype(value.dtype)
    if not keras.backend.is_float_dtype(current) or current == dtype:
        return value
    widened = _widened_from(value, dtype)
    return widened if widened is not None else ops.cast(value, dtype)


_WIDENINGS = {("bfloat16", "float32"), ("float16", "float32"), ("bfloat16", "float64"), ("float16", "float64"),
              ("float32", "float64")}


def _widened_from(value: Any, dtype: str) -> Any:
    """``x`` when ``value`` is a TensorFlow graph tensor made by a widening cast of ``x`` (of ``dtype``), else
    None: casting it back is exact both ways (forward and gradient), so neither cast is needed.  E.g. Keras'
    ``LayerNormalization`` in FP32 on a bf16 input: its op computes in FP32 and returns bf16, the layer casts
    that to its FP32 compute dtype, and the boundary cast would take it back to bf16."""
    try:
        op = value.op  # TF graph tensors only (eager tensors raise, other backends have none)
    except AttributeError:
        return None
    if getattr(op, "type", None) != "Cast" or not op.inputs:
        return None
    source = op.inputs[0]
    names = (keras.backend.standardize_dtype(source.dtype), keras.backend.standardize_dtype(value.dtype))
    return source if names[0] == dtype and names in _WIDENINGS else None


def _casting(call: Callable[..., Any], dtype: str) -> Callable[..., Any]:
    def cast_call(*args: Any, **kwargs: Any) -> Any:
        return keras.tree.map_structure(lambda v: _cast(v, dtype), call(*args, **kwargs))

    return cast_call


def set_output_cast(layer: Any, dtype: str | None) -> None:
    """Cast ``layer``'s floating outputs to ``dtype`` from now on (None: no cast); replaces an earlier cast."""
    if _TARGET in layer.__dict__:
        original = layer.__dict__.pop(_ORIGINAL)
        layer.__dict__.pop(_TARGET)
        if original is None:
            object.__delattr__(layer, "call")
        else:
            object.__setattr__(layer, "call", original)
    if dtype is None:
        return
    object.__setattr__(layer, _ORIGINAL, layer.__dict__.get("call"))
    object.__setattr__(layer, _TARGET, dtype)
    object.__setattr__(layer, "call", _casting(layer.call, dtype))


def install_casts(model: Any) -> dict[str, str]:
    """Cast the outputs of every sublayer that computes in another dtype than its composite, and of every
    composite producing a model output (:data:`~keras_ext.policy.maps.MODEL_OUTPUT`); returns ``{path: dtype}``."""
    casts = {}
    for path, layer, parent in walk_tree(model):
        target = layer.__dict__.get(MODEL_OUTPUT)
        if parent is not None:
            target = boundary_cast(compute_dtype(layer), compute_dtype(parent))
        set_output_cast(layer, target)
        if target is not None:
            casts[path] = target
    return casts
