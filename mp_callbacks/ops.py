"""The tiny array-ops vocabulary the scaler transition is written in.

The transition in :mod:`mp_callbacks.loss_scale.scaler` never touches a framework
directly: it calls the methods of an :class:`ArrayOps` object.  The core ships
the NumPy float32 reference backend (:class:`NumpyOps`) and a plain-Python twin
for host-side transitions in a training loop (:class:`PythonOps`: the same
numbers, without NumPy's per-call cost); the Lightning adapter
supplies torch tensors on the device, the Keras adapter supplies ``keras.ops``
(so the same code runs inside ``tf.function``/XLA and on the torch backend).

Rules every backend follows:

* scales are float32 scalars, trackers and counters are int32 scalars,
  predicates are boolean scalars;
* ``where`` selects without branching (no host sync, traceable);
* no method converts to a Python value.
"""

from __future__ import annotations

import math
import struct
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


_F32 = struct.Struct("<f")


def _f32(x: float) -> float:
    """``x`` rounded to the nearest float32 (overflow gives inf, as NumPy's float32)."""
    try:
        return _F32.unpack(_F32.pack(x))[0]
    except OverflowError:  # beyond float32's range after rounding
        return math.copysign(math.inf, x)


def _i32(x: int) -> int:
    """``x`` wrapped to int32 (as NumPy's int32 arithmetic)."""
    return (x + 0x80000000) % 0x100000000 - 0x80000000


class PythonOps:
    """:class:`NumpyOps`' numbers in plain Python scalars: float32 values as Python floats rounded to
    float32 after every operation, int32 values as wrapped ints, predicates as bools.

    The rule: an operation on float32 inputs is computed in float64 and rounded once to float32,
    which is the correctly rounded float32 result for ``*``, ``+``, min and max (float64 holds
    every float32 product and sum exactly enough: 53 >= 2 * 24 + 2 bits, so the double rounding
    is harmless), so every transition equals :data:`NUMPY_OPS`' bit for bit (tested over every
    preset).  For host-side evaluation of the rules (a decision already read on the host).
    """

    def f32(self, value: Any) -> float:
        return _f32(float(value))

    def i32(self, value: Any) -> int:
        return _i32(int(value))

    def boolean(self, value: Any) -> bool:
        return bool(value)

    def where(self, cond: Any, a: Any, b: Any) -> Any:
        return a if cond else type(a)(b)

    def mul(self, a: Any, b: Any) -> Any:
        return _f32(a * float(b)) if isinstance(a, float) else _i32(a * int(b))

    def add(self, a: Any, b: Any) -> Any:
        return _f32(a + float(b)) if isinstance(a, float) else _i32(a + int(b))

    def minimum(self, a: Any, b: Any) -> Any:
        return a if (a != a or a <= b) else b  # NaN propagates, as np.minimum

    def maximum(self, a: Any, b: Any) -> Any:
        return a if (a != a or a >= b) else b

    def isfinite(self, a: Any) -> bool:
        return math.isfinite(a)

    def logical_and(self, a: Any, b: Any) -> bool:
        return bool(a) and bool(b)

    def logical_or(self, a: Any, b: Any) -> bool:
        return bool(a) or bool(b)

    def logical_not(self, a: Any) -> bool:
        return not a

    def greater_equal(self, a: Any, b: Any) -> bool:
        return a >= b

    def less_equal(self, a: Any, b: Any) -> bool:
        return a <= b

    def not_equal(self, a: Any, b: Any) -> bool:
        return a != b


PYTHON_OPS = PythonOps()
