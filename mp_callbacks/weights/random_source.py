"""The random source of stochastic rounding and the canonical element layout.

Written once for every backend (NumPy reference, torch, ``keras.ops``), so that both
adapters draw the same bits for corresponding elements; :mod:`mp_callbacks.weights`
(the rules that consume the draws) re-exports everything here.

The random source (framework-free, bit-identical in NumPy, torch, ``keras.ops``)
    Counter-based: no generator state, only integers, all arithmetic on
    unsigned 32-bit integers modulo ``2**32`` (``>>`` is the logical shift)::

        mix32(x):  x ^= x >> 16;  x = x * 0x7FEB352D;  x ^= x >> 15;  x = x * 0x846CA68B;  x ^= x >> 16
        key(seed, tensor, step) = mix32(mix32(mix32(seed) ^ tensor) ^ step)
        r[i] = mix32(key ^ i) >> 16

    ``mix32`` is Wellons' ``lowbias32`` integer hash (a bijection of the
    32-bit integers); ``seed`` is the run's seed mod ``2**32``; ``tensor`` the
    weight's position among the optimizer's parameters (param-group order);
    ``step`` the number of updates already applied (skipped steps do not
    count); ``i`` the element's row-major flat index in the weight's canonical
    layout.  The key is computed once per tensor and step (Python integers,
    :func:`sr_key`); an element costs one ``mix32``.

The element layout (so that both adapters draw the same number for corresponding elements)
    The canonical layout of a weight is torch's: ``(out, in, *spatial)`` for
    dense and convolution weights, the stored shape for every other tensor.
    Keras stores kernels as ``(*spatial, in, out)`` (``Dense``: ``(in, out)``;
    ``Conv2D``: ``(kh, kw, in, out)``; ``Conv2DTranspose``'s ``(kh, kw, out,
    in)`` is torch's ``(in, out, kh, kw)`` the same way): the Keras adapter
    indexes a variable named ``kernel`` with two or more dimensions through
    :func:`keras_kernel_to_canonical` (``transpose(kernel, perm)`` is the
    torch weight); biases, normalization scales and embeddings (``(vocab,
    dim)`` in both) are canonical as stored.  :func:`index_strides` gives, per
    axis of the stored array, the step of the canonical index along it, so
    that an adapter builds the index array by broadcasting ``arange``s
    (:func:`layout_index` is the NumPy reference).  The tensor index is the
    position in the list of parameters the optimizer updates, FP32 ones
    included (torch: param-group order; Keras: the optimizer's variable list,
    i.e. ``model.trainable_variables``): models declared layer by layer in the
    same order (weight, then bias) agree.
"""

from __future__ import annotations

from typing import Any

import numpy as np

MASK32 = 0xFFFFFFFF
MIX_MUL1 = 0x7FEB352D
MIX_MUL2 = 0x846CA68B


def s32(value: int) -> int:
    """The int32 whose bits are u32 ``value`` (taken mod ``2**32``): how a backend without uint32 holds it."""
    value = int(value) & MASK32
    return value - (1 << 32) if value >= 1 << 31 else value


def _mix32_head(x: Any, ops: Any) -> Any:
    """``mix32`` without its last ``x ^= x >> 16`` (which leaves the upper 16 bits as they are)."""
    x = ops.xor(x, ops.shr(x, 16))
    x = ops.mul(x, MIX_MUL1)
    x = ops.xor(x, ops.shr(x, 15))
    return ops.mul(x, MIX_MUL2)


def mix32(x: Any, ops: Any) -> Any:
    """Wellons' ``lowbias32`` hash of u32 ``x`` (a bijection of ``[0, 2**32)``)."""
    x = _mix32_head(x, ops)
    return ops.xor(x, ops.shr(x, 16))


class PyIntOps:
    """The integer part of :class:`~mp_callbacks.weights.rounding.RoundingOps` on Python integers (host-side keys)."""

    def u32(self, value: Any) -> int:
        return int(value) & MASK32

    def xor(self, a: int, b: int) -> int:
        return (a ^ b) & MASK32

    def shr(self, a: int, k: int) -> int:
        return (a & MASK32) >> k

    def mul(self, a: int, k: int) -> int:
        return (a * k) & MASK32

    def add_u32(self, a: int, b: int) -> int:
        return (a + b) & MASK32


PY_INT_OPS = PyIntOps()
"""Python-integer backend of the integer operations."""


def sr_key(seed: Any, tensor_index: Any, step: Any, ops: Any = PY_INT_OPS) -> Any:
    """``mix32(mix32(mix32(seed) ^ tensor_index) ^ step)``: the key of one tensor at one update.

    With the default ops, Python ints in, a Python int in ``[0, 2**32)`` out;
    a backend's ops evaluate the same on its u32 scalars (graph-mode counters).
    """
    key = mix32(ops.u32(seed), ops)
    key = mix32(ops.xor(key, ops.u32(tensor_index)), ops)
    return mix32(ops.xor(key, ops.u32(step)), ops)


def sr_thresholds(key: Any, index: Any, ops: Any) -> Any:
    """The 16-bit thresholds ``mix32(key ^ i) >> 16`` of elements with flat indices ``index`` (u32).

    ``mix32``'s last step ``x ^= x >> 16`` changes only the lower 16 bits, so the upper 16 are taken
    before it (three elementwise operations fewer, the same numbers).
    """
    return ops.shr(_mix32_head(ops.xor(ops.u32(key), index), ops), 16)


def keras_kernel_to_canonical(ndim: int) -> tuple[int, ...]:
    """The permutation ``perm`` with ``transpose(keras_kernel, perm)`` = torch's weight: ``(*spatial, in, out)``
    -> ``(out, in, *spatial)``, i.e. ``(ndim - 1, ndim - 2, 0, ..., ndim - 3)`` (the identity below 2 dimensions)."""
    if ndim < 2:
        return tuple(range(ndim))
    return (ndim - 1, ndim - 2, *range(ndim - 2))


def index_strides(shape: Any, to_canonical: tuple[int, ...] | None = None) -> tuple[int, ...]:
    """Per axis of a stored array of ``shape``, the step of the canonical row-major flat index along it.

    The canonical array is ``transpose(stored, to_canonical)`` (None: the stored layout is canonical); the
    canonical index of stored element ``e`` is ``sum(e[a] * strides[a])``.
    """
    shape = tuple(int(n) for n in shape)
    perm = tuple(range(len(shape))) if to_canonical is None else tuple(int(a) for a in to_canonical)
    if sorted(perm) != list(range(len(shape))):
        raise ValueError(f"to_canonical={to_canonical!r} is not a permutation of the {len(shape)} axes of {shape}")
    canonical = [shape[a] for a in perm]
    strides = [0] * len(shape)
    step = 1
    for k in reversed(range(len(perm))):
        strides[perm[k]] = step
        step *= canonical[k]
    return tuple(strides)


def layout_index(shape: Any, to_canonical: tuple[int, ...] | None = None) -> np.ndarray:
    """NumPy reference: the u32 canonical flat indices of a stored array of ``shape`` (:func:`index_strides`)."""
    shape = tuple(int(n) for n in shape)
    index = np.zeros(shape, dtype=np.uint64)
    for axis, (n, stride) in enumerate(zip(shape, index_strides(shape, to_canonical))):
        index = index + (np.arange(n, dtype=np.uint64) * np.uint64(stride)).reshape(
            [1] * axis + [n] + [1] * (len(shape) - axis - 1))
    return (index & np.uint64(MASK32)).astype(np.uint32)
