"""The Keras side of the monitor's auto-fallback: give one layer (and its sub-layers) FP32 compute.

Keras cannot change the dtype of built variables, so a layer moves only when
its variables are float32 already (``*-mixed`` recipes); under ``*-master``
(low-precision variables) :func:`move_layer_to_fp32` names the variables in
the way and changes nothing: the model must be rebuilt with
``apply_policy(model, policy.with_fp32_modules(path))``.  The decision of
*which* layer moves is the core's (:class:`~mp_callbacks.diagnostics.monitor.MonitorCore`).
"""

from __future__ import annotations

import keras

from ..global_policy import keep_layer_in_fp32
from ..layers import own_variables, walk
from ..policy import install_casts

__all__ = ["blocked_message", "move_layer_to_fp32"]


def move_layer_to_fp32(model: keras.Model, path: str) -> list[str] | None:
    """Give layer ``path`` of ``model`` and its sub-layers the float32 policy (and keep it there on
    rebuilds); returns ``[]`` when moved, the paths of its low-precision variables when they block
    the move (nothing changed), None when ``model`` has no such layer."""
    layer = next((sub for p, sub in walk(model) if p == path), None)
    if layer is None:
        return None
    layers = [layer] + [sub for _, sub in walk(layer)]
    low = [v.path for sub in layers for v in own_variables(sub)
           if keras.backend.standardize_dtype(v.dtype) in ("float16", "bfloat16")]
    if low:
        return low
    for sub in layers:
        sub.dtype_policy = keras.DTypePolicy("float32")
    install_casts(model)  # inside a low-precision composite its outputs go back in the composite's dtype
    keep_layer_in_fp32(path)
    return []


def blocked_message(path: str, low: list[str]) -> str:
    """The warning when the variables ``low`` of layer ``path`` block the move."""
    return (f"MixedPrecisionMonitor: {path!r} keeps overflowing but its variables {low} are stored in low "
            "precision, and Keras cannot change the dtype of built variables; rebuild the model with "
            f"keras_ext.apply_policy(model, policy.with_fp32_modules({path!r})) before compile.")
