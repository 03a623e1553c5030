"""The core's rounding ops over ``keras.ops``, the element layout, and the rules as compiled kernels.

* :class:`KerasRoundingOps` (:data:`KERAS_ROUNDING_OPS`): :class:`mp_callbacks.weights.RoundingOps` over
  ``keras.ops``, what :mod:`keras_ext.weights.rounding` evaluates the core's Kahan and stochastic-rounding rules
  with: bit for bit the NumPy reference's numbers (u32 values held as int32 with the same bits);
* :func:`element_index` and :func:`canonical_perm` index a Keras variable's elements in the canonical (torch)
  layout, so the Lightning and Keras adapters draw the same number for corresponding elements;
* :func:`compensated`, :func:`kahan`, :func:`stochastic`: each rule of a variable as one compiled function
  (TensorFlow: ``tf.function(jit_compile=True)``, XLA fusing its reads, arithmetic and writes into one pass;
  JAX: ``jax.jit``, inlined inside Keras' jitted train step; torch, or :data:`FUSED` off: op by op).  The
  numbers are the NumPy reference's bit for bit however the step runs (XLA rounds every bf16 operation to
  nearest even from float32, as the graph does).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from keras import backend, ops

from mp_callbacks.weights import (
    compensated_value,
    index_strides,
    kahan_apply,
    keras_kernel_to_canonical,
    round_with_thresholds,
    s32,
    sr_key,
    sr_thresholds,
)

from ..ops import dtype_name, is_tf

__all__ = ["FUSED", "KERAS_ROUNDING_OPS", "KERNEL_NAMES", "KerasRoundingOps", "canonical_perm", "compensated",
           "element_index", "kahan", "stochastic"]

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


FUSED = True
"""Compile each variable's rule (TensorFlow: one XLA kernel; JAX: ``jax.jit``); False: op by op."""

def _jit(fn: Any, static: tuple[int, ...] = ()) -> Any:
    """``fn`` compiled (:data:`FUSED`; TensorFlow: ``tf.function(jit_compile=True)``, JAX: ``jax.jit`` with
    ``static`` argument positions), else ``fn``."""
    if not FUSED:
        return fn
    if is_tf():
        import tensorflow as tf

        compiled = _compiled(tf, fn)
        # tensors in, never variables: the compiled functions are shared by every optimizer of the process
        return lambda *args: compiled(*(tf.convert_to_tensor(a) if hasattr(a, "dtype") else a for a in args))
    if backend.backend() == "jax":
        return _jax_compiled(fn, static)
    return fn


@functools.cache
def _compiled(tf: Any, fn: Any) -> Any:
    return tf.function(fn, jit_compile=True, autograph=False)


@functools.cache
def _jax_compiled(fn: Any, static: tuple[int, ...]) -> Any:
    import jax

    return jax.jit(fn, static_argnums=static)


def _compensated(w: Any, c: Any) -> Any:
    return compensated_value(w, c, KERAS_ROUNDING_OPS)


def _kahan(w: Any, c: Any, t_new: Any) -> Any:
    return kahan_apply(w, c, t_new, KERAS_ROUNDING_OPS)


def _stochastic(t_new: Any, seed: Any, tensor_index: int, counter: Any, to_canonical: tuple[int, ...] | None) -> Any:
    ops_ = KERAS_ROUNDING_OPS
    key = sr_key(seed, tensor_index, counter, ops_)
    return round_with_thresholds(t_new, sr_thresholds(key, element_index(t_new.shape, to_canonical), ops_), ops_)


def compensated(w: Any, c: Any) -> Any:
    """The FP32 value the optimizer updates under Kahan: ``f32(w) + f32(c)``."""
    return _jit(_compensated)(w, c)


def kahan(w: Any, c: Any, t_new: Any) -> tuple[Any, Any]:
    """``(w', c') = kahan_apply(w, c, t_new)``."""
    return tuple(_jit(_kahan)(w, c, t_new))


def stochastic(t_new: Any, seed: Any, tensor_index: int, counter: Any, to_canonical: tuple[int, ...] | None) -> Any:
    """``t_new`` rounded stochastically to bf16 with the draws of ``sr_key(seed, tensor_index, counter)`` at the
    canonical indices of its elements (``seed``, ``counter``: int32 scalars holding the u32 bits)."""
    return _jit(_stochastic, (2, 4))(t_new, seed, tensor_index, counter, to_canonical)
