"""``keras.ops`` backend of the core's :class:`mp_callbacks.ops.ArrayOps` protocol.

Every method is a plain ``keras.ops`` call, so the core transition
(:func:`mp_callbacks.scaler.next_state`) traces inside ``tf.function``, under
XLA (``jit_compile=True``), inside ``tf.distribute`` merge calls, and runs
eagerly on the torch backend.  No method converts to a Python value.
:func:`is_tf` and :func:`dtype_name` are the backend questions the other
modules ask.
"""

from __future__ import annotations

from typing import Any

import keras
from keras import ops

__all__ = ["KerasOps", "KERAS_OPS", "dtype_name", "is_tf"]


def is_tf() -> bool:
    """True on Keras' TensorFlow backend."""
    return keras.backend.backend() == "tensorflow"


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
        """``a`` where ``cond`` else ``b``, in the dtype of ``a``."""
        a = ops.convert_to_tensor(a)
        b = _tensor(b, ops.dtype(a))
        return ops.where(self.boolean(cond), a, b)

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


KERAS_OPS = KerasOps()
"""The shared :class:`KerasOps` instance."""
