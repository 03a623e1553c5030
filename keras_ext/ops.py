"""``keras.ops`` backend of the core's :class:`mp_callbacks.ops.ArrayOps` protocol.

Every method is a plain ``keras.ops`` call, so the core transition
(:func:`mp_callbacks.loss_scale.scaler.next_state`) traces inside ``tf.function``, under
XLA (``jit_compile=True``), inside ``tf.distribute`` merge calls, and runs
eagerly on the torch backend.  No method converts to a Python value.
The five vector ops of :class:`mp_callbacks.fp8.scaling.FP8ArrayOps` (``divide``,
``reduce_max``, ``roll_left``, ``set_first``, ``zeros``) let the FP8 scaling
transition (:func:`mp_callbacks.fp8.scaling.next_fp8_state`) run the same way, for one
state or a batch (leading axes; a condition with fewer axes selects along them).
:func:`is_tf`, :func:`in_xla_context` and :func:`dtype_name` are the backend questions the other
modules ask.
"""

from __future__ import annotations

from typing import Any

import keras
from keras import ops

__all__ = ["KerasOps", "KERAS_OPS", "dtype_name", "in_xla_context", "is_tf", "read_once"]


def is_tf() -> bool:
    """True on Keras' TensorFlow backend."""
    return keras.backend.backend() == "tensorflow"


def in_xla_context() -> bool:
    """True while tracing a function that TensorFlow compiles with XLA (False on other backends)."""
    if not is_tf():
        return False
    try:
        import tensorflow as tf
        from tensorflow.python.ops import control_flow_util

        return bool(control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph()))
    except Exception:  # pragma: no cover - TF internals moved
        return False


def read_once(variable: Any) -> Any:
    """A Keras variable's value as one tensor: on TensorFlow each use of the variable itself (``.value`` is
    the ``tf.Variable``) is a read op of its own inside a traced step; other backends: ``.value``."""
    if not is_tf():
        return variable.value
    import tensorflow as tf

    return tf.convert_to_tensor(variable.value)  # keras.ops.convert_to_tensor keeps a tf.Variable as it is


def dtype_name(x: Any) -> str:
    """The standardized dtype name of a tensor or variable."""
    return keras.backend.standardize_dtype(getattr(x, "dtype", None) or ops.dtype(x))


def _tensor(value: Any, dtype: str) -> Any:
    """A backend scalar of ``dtype`` from a number, a bool, a tensor or a Variable."""
    if isinstance(value, (bool, int, float)):
        return ops.convert_to_tensor(value, dtype=dtype)
    value = ops.convert_to_tensor(value)
    if ops.dtype(value) != dtype:
        value = ops.cast(value, dtype)
    return value


def _constant_ones(x: Any) -> bool:
    """True when ``x`` is a tensor whose value is known while tracing and all ones."""
    import tensorflow as tf

    value = tf.get_static_value(x)
    return value is not None and bool((value == 1).all())


class KerasOps:
    """Evaluates the scaler transition with ``keras.ops`` (any Keras backend).

    Scales are float32 scalars, trackers and counters int32 scalars and
    predicates boolean scalars, exactly as the NumPy reference.
    """

    def f32(self, value: Any) -> Any:
        """A float32 scalar holding ``value``."""
        return _tensor(value, "float32")

    def i32(self, value: Any) -> Any:
        """An int32 scalar holding ``value``."""
        return _tensor(value, "int32")

    def boolean(self, value: Any) -> Any:
        """A boolean scalar holding ``value``."""
        return _tensor(value, "bool")

    def where(self, cond: Any, a: Any, b: Any) -> Any:
        """``a`` where ``cond`` else ``b``, in the dtype of ``a``.

        A condition with fewer axes than ``a`` (batched FP8 states) selects along ``a``'s leading axes.
        """
        a = ops.convert_to_tensor(a)
        b = _tensor(b, ops.dtype(a))
        cond = self.boolean(cond)
        missing = len(a.shape) - len(cond.shape)
        if len(cond.shape) > 0 and missing > 0:
            cond = ops.reshape(cond, tuple(cond.shape) + (1,) * missing)
        return ops.where(cond, a, b)

    def mul(self, a: Any, b: Any) -> Any:
        """``a * b`` (same dtypes)."""
        return ops.multiply(a, b)

    def add(self, a: Any, b: Any) -> Any:
        """``a + b`` (same dtypes)."""
        return ops.add(a, b)

    def minimum(self, a: Any, b: Any) -> Any:
        """Elementwise minimum."""
        return ops.minimum(a, b)

    def maximum(self, a: Any, b: Any) -> Any:
        """Elementwise maximum."""
        return ops.maximum(a, b)

    def isfinite(self, a: Any) -> Any:
        """True where ``a`` is neither inf nor NaN."""
        return ops.isfinite(a)

    def logical_and(self, a: Any, b: Any) -> Any:
        """Boolean and."""
        return ops.logical_and(a, b)

    def logical_or(self, a: Any, b: Any) -> Any:
        """Boolean or."""
        return ops.logical_or(a, b)

    def logical_not(self, a: Any) -> Any:
        """Boolean not."""
        return ops.logical_not(a)

    def greater_equal(self, a: Any, b: Any) -> Any:
        """``a >= b``."""
        return ops.greater_equal(a, b)

    def less_equal(self, a: Any, b: Any) -> Any:
        """``a <= b``."""
        return ops.less_equal(a, b)

    def not_equal(self, a: Any, b: Any) -> Any:
        """``a != b``."""
        return ops.not_equal(a, b)

    # -- the FP8 vector ops (mp_callbacks.fp8.scaling.FP8ArrayOps) -----------------------------
    def divide(self, a: Any, b: Any) -> Any:
        """``a / b`` in ``a``'s dtype (IEEE: ``x / 0`` is inf, ``0 / 0`` NaN, overflow inf)."""
        a = ops.convert_to_tensor(a)
        b = _tensor(b, ops.dtype(a))
        if is_tf() and _constant_ones(a):
            # TensorFlow's graph optimizer turns 1 / x into Reciprocal, whose vectorized CPU kernel is
            # not correctly rounded (1 ulp off on ~30% of the elements of 8+ element tensors).  2 / x
            # stays a division, and * 0.5 is exact: the same IEEE value (TensorFlow flushes the
            # subnormal results where the two could differ).
            return ops.multiply(ops.divide(_tensor(2.0, ops.dtype(a)), b), _tensor(0.5, ops.dtype(a)))
        return ops.divide(a, b)

    def reduce_max(self, v: Any) -> Any:
        """The largest element along the last axis."""
        return ops.max(v, axis=-1)

    def roll_left(self, v: Any) -> Any:
        """``[v1, ..., v(n-1), v0]`` along the last axis."""
        return ops.roll(v, shift=-1, axis=-1)

    def set_first(self, v: Any, value: Any) -> Any:
        """A new tensor: ``v`` with element 0 of its last axis replaced by ``value``."""
        v = ops.convert_to_tensor(v)
        lead = tuple(v.shape[:-1])
        first = ops.broadcast_to(_tensor(value, ops.dtype(v)), lead)
        return ops.concatenate([ops.expand_dims(first, -1), v[..., 1:]], axis=-1)

    def zeros(self, length: int) -> Any:
        """A float32 vector of ``length`` zeros."""
        return ops.zeros((int(length),), dtype="float32")


KERAS_OPS = KerasOps()
"""The shared :class:`KerasOps` instance."""
