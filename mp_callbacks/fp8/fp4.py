"""FP4 E2M1: the element format of NVFP4, its rounding rules and the array-ops protocol they are written in.

The format
    1 sign bit, 2 exponent bits (bias 1), 1 mantissa bit, no inf and no NaN.  The magnitudes are
    ``0, 0.5, 1, 1.5, 2, 3, 4, 6`` (:data:`E2M1_VALUES`): code ``c`` (0..15) is
    ``(-1) ** (c >> 3) * E2M1_VALUES[c & 7]`` (code 8 is -0).  Two codes share a byte, the element
    with the lower index in the low nibble (torchao's ``pack_uint4``, Transformer Engine's
    ``cast_to_fp4x2``, ``torch.float4_e2m1fn_x2``): :func:`pack_fp4` / :func:`unpack_fp4`.

Rounding a scaled value ``v`` (float32) to E2M1
    The magnitude is clipped to 6 first (saturation: ``|v| > 6`` becomes 6, inf included).  With
    ``a = min(|v|, 6)`` and the spacing of E2M1 around it, ``step = 0.5`` for ``a < 2``, ``1`` for
    ``2 <= a < 4``, ``2`` for ``a >= 4``:

    * round to nearest even (:func:`fp4_round`): ``q = rint(a / step) * step``; ``rint`` rounds
      half to even, and on this grid an even multiple of the step is an even code, so ties go to
      the even code (``0.25 -> 0``, ``0.75 -> 1``, ``1.25 -> 1``, ``1.75 -> 2``, ``2.5 -> 2``,
      ``3.5 -> 4``, ``5 -> 4``), as ``cvt.rn.satfinite.e2m1x2.f32`` and both anchors do;
    * stochastic (:func:`fp4_round` with thresholds): ``q = floor(a / step + u) * step`` with
      ``u = r * 2**-16`` and ``r`` a 16-bit threshold of the counter-based random source
      (:func:`mp_callbacks.weights.sr_thresholds`): ``a`` goes up to the next grid value with
      probability ``frac(a / step)`` (to within ``2**-16``), so ``E[q] = a``.

    The result takes the sign bit of ``v`` (``-0.0`` and negative values that round to zero give
    ``-0``, code 8).  A NaN ``v`` gives ``+0``; the cast flags its block (:mod:`.nvfp4`).

Every rule is written over :class:`NVFP4Ops` (float32 arrays) and evaluated by
:class:`NumpyNVFP4Ops` (the reference) and by the adapters' torch and ``keras.ops`` backends.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import numpy as np

from ..ops import Array, ArrayOps, NumpyOps
from .formats import E4M3, fp8_round

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
"""The E2M1 magnitudes, by the low three bits of the code."""
E2M1_MAX = 6.0
"""The largest E2M1 magnitude."""
FP4_CODE_VALUES = np.array(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=np.float32)
"""The float32 value of each of the 16 codes (index = code; code 8 is -0.0)."""
THRESHOLD_UNIT = 2.0**-16
"""What one unit of a 16-bit stochastic-rounding threshold adds to ``a / step``."""


@runtime_checkable
class NVFP4Ops(ArrayOps, Protocol):
    """What a backend adds to :class:`~mp_callbacks.ops.ArrayOps` (applied elementwise to float32 arrays) to
    evaluate the NVFP4 rules (:mod:`.fp4`, :mod:`.nvfp4`, :mod:`.hadamard`).

    Arrays are float32 unless stated; constants (Python numbers, small NumPy arrays) enter through
    ``f32``; ``minimum`` and ``maximum`` propagate NaN (as NumPy and torch do).  A 2-D array is
    ``(rows, cols)`` with the matmul's contraction axis last; the rules index arrays with basic
    integer slices (``v[:, :, 0]``), which every backend's arrays support.  Nothing converts to
    a host value; the rules read ``a.shape`` (static shapes).  Of the scalar protocol the rules use
    ``f32``, ``where``, ``mul``, ``add``, ``minimum``, ``maximum``, ``isfinite``, ``logical_and``,
    ``greater_equal`` and ``less_equal``, elementwise on arrays (a scalar operand broadcasts).  The
    stochastic-rounding thresholds come from the integer ops of :class:`~mp_callbacks.weights.RoundingOps`
    (:func:`~mp_callbacks.weights.sr_thresholds`).
    """

    def abs(self, a: Array) -> Array:
        """``|a|``."""

    def divide(self, a: Array, b: Array) -> Array:
        """``a / b`` (IEEE float32: ``x / 0`` is inf, ``0 / 0`` NaN)."""

    def rint(self, a: Array) -> Array:
        """Round to the nearest integer, ties to even (``torch.round``, ``keras.ops.round``)."""

    def floor(self, a: Array) -> Array:
        """Round down to an integer."""

    def signbit(self, a: Array) -> Array:
        """True where the sign bit of ``a`` is set (``-0.0`` included)."""

    def e4m3(self, a: Array) -> Array:
        """``a`` rounded to the nearest ``float8_e4m3fn`` value, ties to even, subnormals kept, NaN kept,
        back in float32 (callers clamp to ``[-448, 448]`` first)."""

    def max_abs(self, a: Array) -> Array:
        """The float32 scalar ``max |a|`` over every element (NaN if any element is NaN; 0 if empty)."""

    def tile_max_abs(self, a: Array, rows: int, cols: int) -> Array:
        """``max |a|`` over each ``rows x cols`` tile of 2-D ``a`` (its dims are multiples of the tile):
        shape ``(a_rows / rows, a_cols / cols)``; NaN where a tile holds a NaN."""

    def expand(self, s: Array, rows: int, cols: int) -> Array:
        """Each element of 2-D ``s`` repeated over a ``rows x cols`` tile (the inverse layout of
        ``tile_max_abs``)."""

    def reshape(self, a: Array, shape: tuple[int, ...]) -> Array:
        """``a`` in row-major order with a new shape."""

    def stack(self, arrays: list[Array], axis: int) -> Array:
        """Arrays of one shape joined along a new axis."""

    def pad_to(self, a: Array, rows: int, cols: int) -> Array:
        """2-D ``a`` with zero rows and columns appended up to multiples of ``rows`` and ``cols``."""

    def crop(self, a: Array, rows: int, cols: int) -> Array:
        """The first ``rows x cols`` of 2-D ``a``."""

    def threshold_to_f32(self, r: Array) -> Array:
        """u32 thresholds (below ``2**16``) as float32 (exact)."""


class NumpyNVFP4Ops(NumpyOps):
    """The NumPy reference backend of :class:`NVFP4Ops` (float32 arrays, evaluated eagerly).

    Each method does what the same-named protocol method documents.
    """

    def f32(self, value: Any) -> np.ndarray:
        return np.asarray(value, dtype=np.float32)

    def abs(self, a):
        return np.abs(a)

    def divide(self, a, b):
        with np.errstate(divide="ignore", over="ignore", under="ignore", invalid="ignore"):
            return np.asarray(np.divide(a, b, dtype=np.float32))

    def mul(self, a, b):
        with np.errstate(over="ignore", under="ignore", invalid="ignore"):
            return np.asarray(np.multiply(a, b, dtype=np.float32))

    def add(self, a, b):
        with np.errstate(over="ignore", invalid="ignore"):
            return np.asarray(np.add(a, b, dtype=np.float32))

    def rint(self, a):
        return np.rint(a)

    def floor(self, a):
        return np.floor(a)

    def signbit(self, a):
        return np.signbit(a)

    def e4m3(self, a):
        return fp8_round(a, E4M3, saturate=True)

    def max_abs(self, a):
        a = np.asarray(a, dtype=np.float32)
        if a.size == 0:
            return np.float32(0.0)
        return np.float32(np.nan) if np.isnan(a).any() else np.abs(a).max().astype(np.float32)

    def tile_max_abs(self, a, rows, cols):
        a = np.asarray(a, dtype=np.float32)
        m, k = a.shape
        tiles = np.abs(a).reshape(m // rows, rows, k // cols, cols)
        with np.errstate(invalid="ignore"):
            return tiles.max(axis=(1, 3)) if a.size else np.zeros((m // rows, k // cols), np.float32)

    def expand(self, s, rows, cols):
        return np.repeat(np.repeat(np.asarray(s), rows, axis=0), cols, axis=1)

    def reshape(self, a, shape):
        return np.reshape(a, shape)

    def stack(self, arrays, axis):
        return np.stack(arrays, axis=axis)

    def pad_to(self, a, rows, cols):
        a = np.asarray(a)
        pad = ((0, -a.shape[0] % rows), (0, -a.shape[1] % cols))
        return np.pad(a, pad) if pad[0][1] or pad[1][1] else a

    def crop(self, a, rows, cols):
        return a[:rows, :cols]

    def threshold_to_f32(self, r):
        return np.asarray(r).astype(np.float32)


NUMPY_NVFP4_OPS = NumpyNVFP4Ops()
"""The shared instance of the NumPy reference backend."""


def fp4_round(v: Any, ops: Any = NUMPY_NVFP4_OPS, thresholds: Any = None) -> Any:
    """Float32 ``v`` rounded to an E2M1 value with saturation (the module docstring's rule), as float32.

    ``thresholds``: None rounds to nearest even; u32 values below ``2**16`` (``v``'s shape) round
    stochastically.
    """
    a = ops.minimum(ops.abs(v), ops.f32(E2M1_MAX))
    step = ops.where(ops.greater_equal(a, ops.f32(4.0)), ops.f32(2.0),
                     ops.where(ops.greater_equal(a, ops.f32(2.0)), ops.f32(1.0), ops.f32(0.5)))
    units = ops.divide(a, step)
    if thresholds is None:
        units = ops.rint(units)
    else:
        units = ops.floor(ops.add(units, ops.mul(ops.threshold_to_f32(thresholds), ops.f32(THRESHOLD_UNIT))))
    q = ops.mul(units, step)
    ok = ops.isfinite(q)  # False only for a NaN v
    q = ops.where(ok, q, ops.f32(0.0))
    return ops.where(ops.logical_and(ops.signbit(v), ok), ops.mul(q, ops.f32(-1.0)), q)


# -- codes, packing and E4M3 bits (NumPy) ---------------------------------------------------------


def fp4_codes(values: Any) -> np.ndarray:
    """The uint8 codes (0..15) of E2M1 values (the output of :func:`fp4_round`; ``-0.0`` is code 8).

    A value off the grid is a ``ValueError``.
    """
    v = np.asarray(values, dtype=np.float32)
    a = np.abs(v)
    index = np.where(a < 2, a * 2, np.where(a < 4, a + 2, a / 2 + 4))
    if not np.array_equal(index, np.rint(index)) or (index > 7).any():
        raise ValueError("fp4_codes: values must be E2M1 values (0, ±0.5, ±1, ±1.5, ±2, ±3, ±4, ±6)")
    return (index.astype(np.uint8) | (np.signbit(v).astype(np.uint8) << 3)).astype(np.uint8)


def fp4_values(codes: Any) -> np.ndarray:
    """The float32 values of E2M1 codes (the low four bits of each integer)."""
    return FP4_CODE_VALUES[np.asarray(codes).astype(np.int64) & 0xF]


def pack_fp4(codes: Any) -> np.ndarray:
    """Two codes per byte along the last axis (even length): element ``2i`` in the low nibble."""
    c = np.asarray(codes).astype(np.uint8)
    if c.shape[-1] % 2:
        raise ValueError(f"pack_fp4: the last axis has odd length {c.shape[-1]}")
    return ((c[..., 0::2] & 0xF) | ((c[..., 1::2] & 0xF) << 4)).astype(np.uint8)


def unpack_fp4(packed: Any) -> np.ndarray:
    """Inverse of :func:`pack_fp4`: the codes, twice as many along the last axis."""
    p = np.asarray(packed).astype(np.uint8)
    return np.stack([p & 0xF, p >> 4], axis=-1).reshape(*p.shape[:-1], 2 * p.shape[-1])


def e4m3_bits(values: Any) -> np.ndarray:
    """The ``float8_e4m3fn`` bit patterns (uint8) of float32 values that are E4M3 values (NaN: ``0x7F``
    with its sign; what ``torch.Tensor.view(torch.uint8)`` shows)."""
    v = np.asarray(values, dtype=np.float32)
    sign = np.signbit(v).astype(np.uint8) << 7
    a = np.abs(v).astype(np.float64)
    finite = np.isfinite(a)
    safe = np.where(finite, a, 0.0)
    _, exp = np.frexp(safe)  # safe = m * 2**exp, m in [0.5, 1)
    normal = safe >= 2.0**-6
    biased = np.where(normal, exp - 1 + 7, 0)
    mant = np.where(normal, safe / np.exp2(biased - 7.0) - 1, safe / 2.0**-6) * 8
    if not np.array_equal(mant, np.rint(mant)):
        raise ValueError("e4m3_bits: values must be float8_e4m3fn values")
    bits = (biased.astype(np.uint8) << 3) | mant.astype(np.uint8)
    return np.where(finite, bits, np.uint8(0x7F)).astype(np.uint8) | sign


def e4m3_from_bits(bits: Any) -> np.ndarray:
    """The float32 values of ``float8_e4m3fn`` bit patterns (``S.1111.111`` is NaN)."""
    b = np.asarray(bits).astype(np.int64) & 0xFF
    exp, mant = (b >> 3) & 0xF, b & 7
    mag = np.where(exp == 0, mant * 2.0**-9, (8 + mant) * np.exp2(exp - 10.0))
    mag = np.where((b & 0x7F) == 0x7F, np.nan, mag)
    return np.where(b >> 7, -mag, mag).astype(np.float32)
