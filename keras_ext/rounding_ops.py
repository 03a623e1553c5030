"""The core's rounding ops (:class:`mp_callbacks.weights.rounding.RoundingOps`) over ``keras.ops``, and the element
layout.

What :mod:`keras_ext.rounding` evaluates the core's Kahan and
stochastic-rounding rules with: bit for bit the NumPy reference's numbers and
:mod:`lightning_ext.rounding_ops`' (u32 values held as int32 with the same
bits).  :func:`element_index` and :func:`canonical_perm` index a Keras
variable's elements in the canonical (torch) layout, so both adapters draw the
same number for corresponding elements.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from keras import ops

from mp_callbacks.weights import index_strides, keras_kernel_to_canonical, s32

from .ops import dtype_name

__all__ = ["KERAS_ROUNDING_OPS", "KERNEL_NAMES", "KerasRoundingOps", "canonical_perm", "element_index"]

KERNEL_NAMES = ("kernel",)
"""Keras variable names stored as ``(*spatial, in, out)`` (indexed through the torch layout)."""


class KerasRoundingOps:
    """:class:`mp_callbacks.weights.rounding.RoundingOps` over ``keras.ops`` (any backend, traced or eager).

    u32 values live in int32 tensors (the same bits: multiplication and addition wrap modulo ``2**32``;
    ``shr`` masks the sign extension of the arithmetic shift); bf16 arithmetic is the backend's (computed
    in float32, rounded once to nearest even: TensorFlow, XLA and torch alike)."""

    def to_f32(self, a: Any) -> Any:
        return ops.cast(a, "float32")

    def to_like(self, x: Any, like: Any) -> Any:
        return ops.cast(x, dtype_name(like))

    def add(self, a: Any, b: Any) -> Any:
        return ops.add(a, b)

    def sub(self, a: Any, b: Any) -> Any:
        return ops.subtract(a, b)

    def isnan(self, a: Any) -> Any:
        return ops.isnan(a)

    def where(self, cond: Any, a: Any, b: Any) -> Any:
        return ops.where(cond, a, b)

    def u32(self, value: Any) -> Any:
        if isinstance(value, int):
            return ops.convert_to_tensor(s32(value), dtype="int32")
        value = ops.convert_to_tensor(value)
        return value if dtype_name(value) == "int32" else ops.cast(value, "int32")

    def index(self, like: Any) -> Any:
        return element_index(tuple(like.shape))

    def xor(self, a: Any, b: Any) -> Any:
        return ops.bitwise_xor(self.u32(a), self.u32(b))

    def shr(self, a: Any, k: int) -> Any:
        return ops.bitwise_and(ops.right_shift(self.u32(a), k), (1 << (32 - k)) - 1)

    def mul(self, a: Any, k: int) -> Any:
        return ops.multiply(self.u32(a), self.u32(k))

    def add_u32(self, a: Any, b: Any) -> Any:
        return ops.add(self.u32(a), self.u32(b))

    def f32_bits(self, x: Any) -> Any:
        return ops.view(ops.cast(x, "float32"), "int32")

    def bf16_from_bits(self, bits: Any) -> Any:
        # arithmetic shift then int16: the upper 16 bits, exactly
        return ops.view(ops.cast(ops.right_shift(self.u32(bits), 16), "int16"), "bfloat16")


KERAS_ROUNDING_OPS = KerasRoundingOps()


def element_index(shape: Sequence[int], to_canonical: tuple[int, ...] | None = None) -> Any:
    """int32 (u32 bits) canonical flat indices of a stored array of ``shape`` (broadcast ``arange``s with
    :func:`~mp_callbacks.weights.random_source.index_strides`; equals
    :func:`~mp_callbacks.weights.random_source.layout_index`)."""
    shape = tuple(int(n) for n in shape)
    index = ops.zeros(shape, dtype="int32")
    for axis, (n, stride) in enumerate(zip(shape, index_strides(shape, to_canonical))):
        step = ops.multiply(ops.arange(n, dtype="int32"), ops.convert_to_tensor(s32(stride), dtype="int32"))
        index = ops.add(index, ops.reshape(step, [1] * axis + [n] + [1] * (len(shape) - axis - 1)))
    return index


def canonical_perm(variable: Any) -> tuple[int, ...] | None:
    """The permutation to the canonical layout: a Keras kernel's (:data:`KERNEL_NAMES`, 2+ dims), else None."""
    name = str(getattr(variable, "name", "")).split("/")[-1].split(":")[0]
    ndim = len(variable.shape)
    return keras_kernel_to_canonical(ndim) if name in KERNEL_NAMES and ndim >= 2 else None
