"""The core's FP8 granularities in ``keras.ops``: rowwise, blockwise and MXFP8 casts and the FP8 matmul.

The rule of each kind is :mod:`mp_callbacks.fp8.granularity`; :func:`block_qdq` is its cast
(equal to the NumPy reference :func:`~mp_callbacks.fp8.granularity.quantize` bit for bit on
TensorFlow; JAX without 64-bit floats divides in float32), returned dequantized, as the rest of
:mod:`keras_ext.fp8` works with dequantized float32 values.  :func:`block_matmul` is the FP8
matmul at such a granularity: every matmul casts its operands along its own contraction axis,
as the Lightning adapter's FP8 matmul does (``x`` and the kernel along ``in`` for the output; the
output gradient along ``out`` and the kernel along ``out`` for ``dx``; ``x`` and the output
gradient along the tokens for the kernel gradient, or high precision with ``weight_grad_hp``).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from keras import ops

from mp_callbacks.fp8 import AMAX_EPSILON, E8M0_BIAS, E8M0_NAN, FP8Granularity, block_shape, fp8_format

from ..ops import is_tf

__all__ = ["block_matmul", "block_qdq", "contracted_axes"]


def _nan() -> Any:
    return ops.convert_to_tensor(np.float32(np.nan))


def _dims(x: Any) -> tuple[Any, ...]:
    """The shape, static where known (ints), else the backend's scalar tensors (TF graphs)."""
    static, dynamic = x.shape, ops.shape(x)
    return tuple(int(s) if s is not None else d for s, d in zip(static, dynamic))


def _block_view(x: Any, blocks: tuple[int, ...]) -> Any:
    """``x`` zero-padded to whole blocks as ``(n0, b0, n1, b1, ...)`` (a whole axis: ``(1, n)``)."""
    dims = _dims(x)
    pad = [(0, 0 if b <= 1 else (-n) % b) for n, b in zip(dims, blocks)]
    if any(isinstance(p, int) and p or not isinstance(p, int) for _, p in pad):
        x = ops.pad(x, pad)
    view: list[Any] = []
    for n, b, (_, p) in zip(dims, blocks, pad):
        view += [1, n] if b == 0 else [(n + p) // b, b]
    return ops.reshape(x, view)


def _block_amax(x: Any, blocks: tuple[int, ...]) -> Any:
    """max |x| of every block, NaN where a block holds NaN (whatever the backend's max does with NaN)."""
    blocked = _block_view(ops.abs(x), blocks)
    axes = tuple(range(1, len(blocked.shape), 2))
    amax = ops.max(blocked, axis=axes)
    return ops.where(ops.any(ops.isnan(blocked), axis=axes), _nan(), amax)


def _expand(values: Any, blocks: tuple[int, ...], like: Any) -> Any:
    """One value per block back to ``like``'s shape (a whole axis broadcasts)."""
    dims = _dims(like)
    for axis, b in enumerate(blocks):
        if b > 1:
            values = ops.repeat(values, b, axis=axis)
    return values[tuple(slice(None) if b == 0 else slice(0, n) for n, b in zip(dims, blocks))]


def _scale(amax: Any, fmax: float, pow2: bool) -> Any:
    wide = "float64" if is_tf() else "float32"
    scale = ops.cast(ops.divide(fmax, ops.maximum(ops.cast(amax, wide), AMAX_EPSILON)), "float32")
    return ops.exp2(ops.floor(ops.log2(scale))) if pow2 else scale


def _mx_factor(amax: Any, fmax: float, rounding: str) -> tuple[Any, Any]:
    """``(what a block's data is multiplied by, what its FP8 values are multiplied by to read back)``."""
    if rounding == "rceil":
        descale = ops.divide(amax, fmax)
        exp = ops.clip(ops.ceil(ops.log2(descale)), -E8M0_BIAS, E8M0_BIAS) + E8M0_BIAS
        exp = ops.where(ops.isinf(descale), 254.0, ops.where(ops.isnan(descale), float(E8M0_NAN),
                                                              ops.nan_to_num(exp)))
        rcp = ops.where(ops.equal(exp, 0.0), 1.0, ops.exp2(E8M0_BIAS - exp))
        rcp = ops.where(ops.equal(exp, 254.0), 2.0**-127, rcp)
        factor = ops.where(ops.isnan(descale), descale, rcp)
    else:
        emax = int(math.floor(math.log2(fmax)))
        bits = ops.view(ops.cast(amax, "float32"), "int32")
        pow2 = ops.bitwise_and(ops.right_shift(bits, 23), 0xFF) - E8M0_BIAS
        exp = ops.cast(ops.clip(pow2 - emax, -E8M0_BIAS, E8M0_BIAS + 1) + E8M0_BIAS, "float32")
        exp = ops.where(ops.isnan(amax), float(E8M0_NAN), exp)
        scale = ops.maximum(ops.exp2(exp - E8M0_BIAS), 2.0**-126)
        factor = ops.divide(1.0, scale)
    back = ops.where(ops.equal(exp, float(E8M0_NAN)), _nan(), ops.exp2(exp - E8M0_BIAS))
    return factor, back


def block_qdq(x: Any, granularity: FP8Granularity, fmt: Any, *, axis: int = -1, weight: bool = False
              ) -> tuple[Any, Any]:
    """``(x after the FP8 round trip, stats [amax, saturated, flushed, elements])`` at ``granularity`` along
    the contraction ``axis`` (float32)."""
    fmt = fp8_format(fmt)
    fmax = float(fmt.max)
    x32 = ops.cast(x, "float32")
    moved = ops.moveaxis(x32, axis, -1)
    ndim = len(moved.shape)
    blocks = block_shape(granularity.kind, ndim, weight=weight, block=granularity.block,
                         mx_block=granularity.mx_block)
    static = [None if n is None else int(n) for n in moved.shape]
    # a block longer than a static axis is that axis (the reference's min(block, n))
    blocks = tuple(0 if b > 1 and n is not None and b >= n else b for b, n in zip(blocks, static))
    amax = _block_amax(moved, blocks)
    if granularity.kind == "mxfp8":
        factor, back = _mx_factor(amax, fmax, granularity.mx_rounding)
    else:
        factor = _scale(amax, fmax, granularity.rounds_to_pow2)
        back = ops.divide(1.0, factor)
    y = ops.multiply(moved, _expand(factor, blocks, moved))
    q = ops.cast(ops.cast(ops.clip(y, -fmax, fmax), fmt.name), "float32")
    out = ops.moveaxis(ops.multiply(q, _expand(back, blocks, moved)), -1, axis)
    tensor_amax = ops.where(ops.any(ops.isnan(x32)), _nan(), ops.max(ops.abs(x32)))
    saturated = ops.sum(ops.cast(ops.greater(ops.abs(y), fmax), "float32"))
    flushed = ops.sum(ops.cast(ops.logical_and(ops.not_equal(moved, 0.0), ops.equal(q, 0.0)), "float32"))
    return out, ops.stack([tensor_amax, saturated, flushed, ops.cast(ops.size(x32), "float32")])


def contracted_axes(equation: str) -> int | None:
    """How many trailing input axes an ``EinsumDense`` equation contracts with the kernel's leading axes
    (``"abc,cd->abd"``: 1; ``"abcd,cde->abe"``: 2), None when it has another form."""
    lhs, out = equation.replace(" ", "").split("->")
    x, k = lhs.split(",")
    shared = [c for c in x if c in k and c not in out]
    n = len(shared)
    if not n or x[-n:] != "".join(shared) or k[:n] != "".join(shared) or k[n:] != out[len(out) - len(k) + n:]:
        return None
    if out != x[:-n] + k[n:]:
        return None
    return n


def block_matmul(x: Any, kernel: Any, granularity: FP8Granularity, formats: dict[str, Any], contracted: int = 1
                 ) -> Any:
    """``x @ kernel`` over ``contracted`` axes with FP8 operands cast per matmul (see the module docstring).

    ``formats``: the FP8 format of ``inputs``, ``weights`` and ``grad_outputs``."""
    k_shape = tuple(int(n) for n in kernel.shape)
    k_in, k_out = math.prod(k_shape[:contracted]), math.prod(k_shape[contracted:])
    batch = _dims(x)[: len(x.shape) - contracted]
    fi, fw, fg = formats["inputs"], formats["weights"], formats["grad_outputs"]
    hp = granularity.weight_grad_hp

    @ops.custom_gradient
    def mm(x2: Any, k2: Any) -> Any:
        xq, _ = block_qdq(x2, granularity, fi, axis=-1)
        kq, _ = block_qdq(k2, granularity, fw, axis=0, weight=True)

        def grad(*args: Any, upstream: Any = None, variables: Any = None) -> Any:
            if upstream is None:
                (upstream,) = args
            g = ops.cast(upstream, "float32")
            gx, _ = block_qdq(g, granularity, fg, axis=-1)
            kc, _ = block_qdq(k2, granularity, fw, axis=1, weight=True)
            dx = ops.matmul(gx, ops.transpose(kc))
            if hp:
                dk = ops.matmul(ops.transpose(x2), g)
            else:
                xc, _ = block_qdq(x2, granularity, fi, axis=0)
                gc, _ = block_qdq(g, granularity, fg, axis=0)
                dk = ops.matmul(ops.transpose(xc), gc)
            return dx, dk

        return ops.matmul(xq, kq), grad

    y = mm(ops.reshape(ops.cast(x, "float32"), (-1, k_in)), ops.reshape(ops.cast(kernel, "float32"), (k_in, k_out)))
    return ops.reshape(y, (*batch, *k_shape[contracted:]))
