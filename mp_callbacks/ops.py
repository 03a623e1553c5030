"""The tiny array-ops vocabulary the scaler transition is written in.

The transition in :mod:`mp_callbacks.loss_scale.scaler` never touches a framework
directly: it calls the methods of an :class:`ArrayOps` object.  The core ships
the NumPy float32 reference backend (:class:`NumpyOps`); the Lightning adapter
supplies torch tensors on the device, the Keras adapter supplies ``keras.ops``
(so the same code runs inside ``tf.function``/XLA and on the torch backend).

Rules every backend follows:

* scales are float32 scalars, trackers and counters are int32 scalars,
  predicates are boolean scalars;
* ``where`` selects without branching (no host sync, traceable);
* no method converts to a Python value.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import numpy as np

Array = Any
"""A backend scalar: ``np.ndarray``, ``torch.Tensor`` or a Keras tensor."""


@runtime_checkable
class ArrayOps(Protocol):
    """What a backend must provide to evaluate the scaler transition."""

    def f32(self, value: Any) -> Array:
        """A float32 scalar holding ``value`` (a Python number or a backend scalar)."""

    def i32(self, value: Any) -> Array:
        """An int32 scalar holding ``value`` (a number, a bool or a backend scalar)."""

    def boolean(self, value: Any) -> Array:
        """A boolean scalar holding ``value``."""

    def where(self, cond: Array, a: Array, b: Array) -> Array:
        """``a`` where ``cond`` else ``b`` (same dtype as ``a``)."""

    def mul(self, a: Array, b: Array) -> Array:
        """``a * b`` in ``a``'s dtype (float32 overflow gives inf, as in the anchors)."""

    def add(self, a: Array, b: Array) -> Array:
        """``a + b`` in ``a``'s dtype."""

    def minimum(self, a: Array, b: Array) -> Array:
        """Elementwise minimum."""

    def maximum(self, a: Array, b: Array) -> Array:
        """Elementwise maximum."""

    def isfinite(self, a: Array) -> Array:
        """True where ``a`` is neither inf nor NaN."""

    def logical_and(self, a: Array, b: Array) -> Array:
        """Boolean and."""

    def logical_or(self, a: Array, b: Array) -> Array:
        """Boolean or."""

    def logical_not(self, a: Array) -> Array:
        """Boolean not."""

    def greater_equal(self, a: Array, b: Array) -> Array:
        """``a >= b``."""

    def less_equal(self, a: Array, b: Array) -> Array:
        """``a <= b``."""

    def not_equal(self, a: Array, b: Array) -> Array:
        """``a != b``."""


class NumpyOps:
    """Reference backend: NumPy float32/int32 0-d arrays, evaluated eagerly.

    Each method does what the same-named :class:`ArrayOps` method documents.
    """

    def f32(self, value: Any) -> np.ndarray:
        return np.asarray(value, dtype=np.float32)

    def i32(self, value: Any) -> np.ndarray:
        return np.asarray(value, dtype=np.int32)

    def boolean(self, value: Any) -> np.ndarray:
        return np.asarray(value, dtype=np.bool_)

    def where(self, cond, a, b):
        a = np.asarray(a)
        return np.asarray(np.where(cond, a, np.asarray(b, dtype=a.dtype)), dtype=a.dtype)

    def mul(self, a, b):
        with np.errstate(over="ignore", under="ignore"):
            return np.asarray(np.multiply(a, b, dtype=np.asarray(a).dtype))

    def add(self, a, b):
        return np.asarray(np.add(a, b, dtype=np.asarray(a).dtype))

    def minimum(self, a, b):
        return np.minimum(a, b)

    def maximum(self, a, b):
        return np.maximum(a, b)

    def isfinite(self, a):
        return np.isfinite(a)

    def logical_and(self, a, b):
        return np.logical_and(a, b)

    def logical_or(self, a, b):
        return np.logical_or(a, b)

    def logical_not(self, a):
        return np.logical_not(a)

    def greater_equal(self, a, b):
        return np.greater_equal(a, b)

    def less_equal(self, a, b):
        return np.less_equal(a, b)

    def not_equal(self, a, b):
        return np.not_equal(a, b)


NUMPY_OPS = NumpyOps()
"""The shared instance of the reference backend."""
