"""FP8 formats and the NumPy reference of the cast.

The bit layouts and ranges of ``float8_e4m3fn`` (forward tensors) and
``float8_e5m2`` (gradients), the HYBRID assignment of formats to the tensors of
an FP8 matmul, and the float32 reference of what a tensor becomes after an FP8
round trip (:func:`fp8_round`, :func:`quantize_dequantize`) with the shares of
its elements that saturate or flush to zero (:func:`saturated_fraction`,
:func:`flushed_fraction`).  The adapters' casts are tested against these.
The scaling rule is in :mod:`mp_callbacks.fp8`, its settings in
:mod:`mp_callbacks.fp8.config`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

FLOAT32_MAX = float(np.finfo(np.float32).max)
"""The largest float32 (where an overflowing scale is clamped)."""


class FP8ConfigError(ValueError):
    """An FP8 scaling setting is out of its allowed range."""


# -- formats ----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class FP8Format:
    """Bit layout and range of an 8-bit float format (1 sign bit).

    Attributes:
      name: the dtype name shared by torch, ml_dtypes and Keras (``"float8_e4m3fn"``).
      exponent_bits, mantissa_bits, exponent_bias: the layout.
      max: the largest finite value.
      min_normal: the smallest positive normal value, ``2**(1 - bias)``.
      min_subnormal: the smallest positive value, ``min_normal * 2**-mantissa_bits``.
      has_inf: whether the format has infinities (e5m2: yes; e4m3fn: no, only NaN).
    """

    name: str
    exponent_bits: int
    mantissa_bits: int
    exponent_bias: int
    max: float
    min_normal: float
    min_subnormal: float
    has_inf: bool

    @property
    def eps(self) -> float:
        """Spacing of representable numbers just above 1.0."""
        return 2.0**-self.mantissa_bits

    @property
    def min_exponent(self) -> int:
        """Exponent of :attr:`min_normal` (subnormals share its spacing)."""
        return 1 - self.exponent_bias


E4M3 = FP8Format("float8_e4m3fn", 4, 3, 7, 448.0, 2.0**-6, 2.0**-9, has_inf=False)
"""``float8_e4m3fn``: 4 exponent bits, 3 mantissa bits, no inf (S.1111.111 is NaN): max 448."""
E5M2 = FP8Format("float8_e5m2", 5, 2, 15, 57344.0, 2.0**-14, 2.0**-16, has_inf=True)
"""``float8_e5m2``: IEEE-style 5 exponent bits, 2 mantissa bits: max 57344."""

FP8_FORMATS: dict[str, FP8Format] = {E4M3.name: E4M3, E5M2.name: E5M2}
"""The formats by canonical name."""
FORMAT_ALIASES: dict[str, str] = {
    "float8_e4m3fn": E4M3.name, "e4m3fn": E4M3.name, "e4m3": E4M3.name, "fp8_e4m3": E4M3.name,
    "float8_e5m2": E5M2.name, "e5m2": E5M2.name, "fp8_e5m2": E5M2.name,
}
"""Accepted spellings (framework dtype objects are read by their name)."""

HYBRID: dict[str, str] = {"forward": E4M3.name, "backward": E5M2.name}
"""The HYBRID recipe of Transformer Engine, Keras and torchao: e4m3 forward, e5m2 backward."""
TENSOR_ROLES: dict[str, str] = {"inputs": "forward", "weights": "forward", "grad_outputs": "backward"}
"""The three scaled tensors of an FP8 matmul and the pass each belongs to."""


def fp8_format(value: Any) -> FP8Format:
    """An :class:`FP8Format` from itself, a name/alias, or a dtype object (``torch.float8_e5m2``)."""
    if isinstance(value, FP8Format):
        return value
    text = (getattr(value, "name", None) if not isinstance(value, str) else value) or str(value)
    text = str(text).replace("torch.", "").strip().lower()
    if text in FORMAT_ALIASES:
        return FP8_FORMATS[FORMAT_ALIASES[text]]
    raise FP8ConfigError(
        f"{value!r} is not an FP8 format; valid: {', '.join(FP8_FORMATS)} "
        f"(aliases: {', '.join(sorted(set(FORMAT_ALIASES) - set(FP8_FORMATS)))})"
    )


# -- NumPy reference of the cast and the diagnostics ------------------------------------------


def fp8_round(x: Any, fmt: Any = E4M3, saturate: bool = True) -> np.ndarray:
    """``x`` (float32) rounded to the nearest value of ``fmt``, ties to even, as float32.

    ``saturate=True`` (Transformer Engine's satfinite cast, Keras's clip before
    the cast): anything beyond ``±max``, infinities included, becomes ``±max``.
    ``saturate=False`` (a plain cast, as ``ml_dtypes``): a value that rounds
    beyond max becomes inf (e5m2) or NaN (e4m3fn, which has no inf).  NaN stays
    NaN; values below half the smallest subnormal flush to (signed) zero.
    """
    fmt = fp8_format(fmt)
    x = np.asarray(x, dtype=np.float32)
    mag = np.abs(x.astype(np.float64))
    finite = np.isfinite(mag)
    safe = np.where(finite, mag, 0.0)
    _, exp = np.frexp(safe)  # safe = m * 2**exp, m in [0.5, 1): binade exponent exp - 1
    spacing = np.exp2(np.maximum(exp - 1, fmt.min_exponent) - fmt.mantissa_bits)
    q = np.rint(safe / spacing) * spacing  # exact in float64; rint is round-half-even
    if saturate:
        q = np.where(finite, np.minimum(q, fmt.max), fmt.max)
    else:
        over = np.inf if fmt.has_inf else np.nan
        q = np.where(finite & (q <= fmt.max), q, over)
    q = np.where(np.isnan(x), np.nan, q)
    return np.copysign(q, x).astype(np.float32)


def _scaled(x: Any, scale: Any, inverse: bool) -> np.ndarray:
    x = np.asarray(x, dtype=np.float32)
    scale = np.float32(scale)
    with np.errstate(over="ignore", divide="ignore", invalid="ignore", under="ignore"):
        return x / scale if inverse else x * scale


def quantize_dequantize(x: Any, scale: Any, fmt: Any = E4M3, *, inverse: bool = False) -> np.ndarray:
    """The value ``x`` comes back as after an FP8 round trip (NumPy float32 reference).

    ``inverse=False`` (Transformer Engine): ``q = fp8(x * scale)``, returns
    ``q * (1 / scale)``.  ``inverse=True`` (Keras, whose ``scale`` is our
    ``scale_inv``): ``q = fp8(x / scale)``, returns ``q * scale``.  The cast
    saturates and rounds to nearest even (:func:`fp8_round`).
    """
    scale32 = np.float32(scale)
    q = fp8_round(_scaled(x, scale32, inverse), fmt, saturate=True)
    with np.errstate(over="ignore", divide="ignore", invalid="ignore", under="ignore"):
        back = scale32 if inverse else np.float32(1.0) / scale32
        return (q * back).astype(np.float32)


def _fraction(mask: np.ndarray) -> float:
    return float(mask.mean()) if mask.size else 0.0


def saturated_fraction(x: Any, scale: Any, fmt: Any = E4M3, *, inverse: bool = False) -> float:
    """Share of the elements of ``x`` whose scaled magnitude exceeds ``fmt.max`` (clipped by the cast).

    Infinities count; NaN does not.  ``scale`` and ``inverse`` as in :func:`quantize_dequantize`.
    """
    scaled = _scaled(x, scale, inverse)
    return _fraction(np.abs(scaled) > fp8_format(fmt).max)


def flushed_fraction(x: Any, scale: Any, fmt: Any = E4M3, *, inverse: bool = False) -> float:
    """Share of the elements of ``x`` that are non-zero but become zero in FP8 at this scale.

    That is ``|x * scale| <= min_subnormal / 2`` (the exact half rounds to even, i.e. to 0).
    """
    x = np.asarray(x, dtype=np.float32)
    q = fp8_round(_scaled(x, scale, inverse), fmt, saturate=True)
    return _fraction((x != 0) & ~np.isnan(x) & (q == 0))
