"""The step's non-finite check and unscale of a Keras optimizer's gradients (the twin of
:mod:`lightning_ext.grad_check`).

Rules: :func:`found_inf` is one 0-d flag over every gradient (on TensorFlow's CPU one op,
:mod:`keras_ext.check_native`; else ``isfinite`` + ``all`` per gradient, one ``all`` over them: no host read,
traceable by every backend; an ``IndexedSlices`` gradient is checked on its values); :func:`unscale`
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

from .check_native import native_check
from .ops import dtype_name, in_xla_context, is_tf

__all__ = ["found_inf", "scaled_loss", "unscale"]


def found_inf(grads: Sequence[Any]) -> Any:
    """A 0-d bool: some gradient holds an inf or NaN (no host read; False for no gradients).  One op
    (:mod:`keras_ext.check_native`) where it applies and every gradient is a dense float32/bfloat16 tensor,
    outside XLA; else ``isfinite`` + ``all`` per gradient."""
    present = [g for g in grads if g is not None]
    native = native_check()
    if (native is not None and not in_xla_context() and not any(map(_is_sparse, present))
            and all(dtype_name(g) in ("float32", "bfloat16") for g in present)):
        return native.found_inf(present)
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
