"""The step's non-finite check and unscale of a Keras optimizer's gradients.

Rules: :func:`found_inf` is one 0-d flag over every gradient (``isfinite`` + ``all`` per gradient, one ``all``
over them, in ``keras.ops``: no host read, traceable by every backend and by XLA; an ``IndexedSlices``
gradient is checked on its values); :func:`unscale`
divides a gradient by the scale in float32 after widening it (an ``IndexedSlices`` stays sparse), or only
widens it when scaling is off; :func:`scaled_loss` is the loss times the scale, and with scaling off (the
core's known scale 1, :func:`~mp_callbacks.loss_scale.transition.fixed_scale`) the loss itself, in the dtype
the product would have had (a bfloat16/float16 loss widened to float32): no read of the scale variable, no
multiply in the forward nor in the backward.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import keras
from keras import ops

from ..ops import dtype_name, is_tf

__all__ = ["found_inf", "scaled_loss", "unscale"]


def found_inf(grads: Sequence[Any]) -> Any:
    """A 0-d bool: some gradient holds an inf or NaN (no host read; False for no gradients; None entries are
    ignored)."""
    present = [g for g in grads if g is not None]
    flags = [ops.all(ops.isfinite(_dense(g))) for g in present]
    if not flags:
        return ops.convert_to_tensor(False)
    return ops.logical_not(ops.all(ops.stack(flags)))


def unscale(g: Any, scale: Any) -> Any:
    """``g / scale`` in float32 (low-precision gradients are widened first; IndexedSlices stay sparse);
    ``scale=None`` (scaling off: the scale is 1) only widens."""
    if _is_sparse(g):
        import tensorflow as tf

        return tf.IndexedSlices(unscale(g.values, scale), g.indices, g.dense_shape)
    if dtype_name(g) != "float32":
        g = ops.cast(g, "float32")
    return g if scale is None else ops.divide(g, scale)


def scaled_loss(loss: Any, scale: Any) -> Any:
    """``loss * scale``; ``scale=None`` (scaling off: the scale is 1) gives ``loss`` unmultiplied, widened to
    the dtype ``loss * float32 scale`` has (``loss`` itself when it is already float32 or wider)."""
    if scale is not None:
        return ops.multiply(loss, scale)
    dtype = keras.backend.result_type(dtype_name(loss), "float32")
    return loss if dtype_name(loss) == dtype else ops.cast(loss, dtype)


def _is_sparse(g: Any) -> bool:
    if not is_tf():
        return False
    import tensorflow as tf

    return isinstance(g, tf.IndexedSlices)


def _dense(g: Any) -> Any:
    return g.values if _is_sparse(g) else g
