"""FP8 scaling granularity: one scale per tensor, per row, per block or per MX block.

The rule, for a tensor ``x`` cast to an FP8 format with maximum ``fmax`` along the matmul's
contraction axis (``axis``), every scale *current* (from this step's amax):

``tensorwise``
    one scale ``s = fmax / max(amax(x), eps)`` (delayed scaling keeps its own transition:
    :mod:`mp_callbacks.fp8.scaling`).
``rowwise``
    one scale per row: ``amax`` over ``axis`` only (torchao's ``rowwise`` recipe; its
    ``axiswise`` granularity).  ``pow2_scales`` rounds each scale *down* to a power of two
    (``2 ** floor(log2 s)``; torchao's rowwise default), so ``x * s`` only moves exponents.
``blockwise``
    one scale per ``1 x block`` tile along ``axis`` for activations and output gradients,
    per ``block x block`` tile for weights (the last two dimensions; DeepSeek-V3's recipe,
    Transformer Engine's ``Float8BlockScaling``: 128, power-of-two scales by default).
``mxfp8``
    OCP Microscaling: one E8M0 exponent per ``1 x 32`` block along ``axis``; the block's data
    is ``x / 2 ** (e - 127)``.  ``floor`` (the OCP spec): ``e - 127 = floor(log2 amax) -
    emax(fmt)`` (``emax`` 8 for e4m3, 15 for e5m2); ``rceil`` (cuBLAS / Transformer Engine):
    ``e - 127 = ceil(log2(amax / fmax))``.  A NaN amax gives ``e = 255`` (the block is NaN).

Every cast saturates (``|x * s| > fmax`` becomes ``±fmax``) and rounds to nearest even
(:func:`~mp_callbacks.fp8.formats.fp8_round`).  A dimension that is not a multiple of the
block ends in a shorter block: the same as zero padding, since zeros never change an amax
(Transformer Engine pads; torchao's MX cast refuses such shapes).  An amax that is not
finite spoils its block only: NaN gives a NaN scale (MX: ``e = 255``), inf a zero scale (so the
block casts to NaN) or, under MX, the largest exponent (the inf saturates, as torchao's cast);
the adapters check every block's amax and skip such a step, as with per-tensor scales.

:func:`quantize` returns ``(q, scales)`` (``q``: the FP8 values as float32; ``scales``: float32
multipliers, or uint8 biased exponents for ``mxfp8``, one per block, the blocked axes kept
with the block count as their length); :func:`dequantize` inverts it.  Both are the NumPy
references the adapters and torchao are tested against.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import numpy as np

from ..settings import Settings, is_int
from .formats import E4M3, FP8ConfigError, FP8Format, fp8_format, fp8_round

__all__ = ["FP8Granularity", "GRANULARITIES", "MX_ROUNDINGS", "block_shape", "dequantize", "matmul_snr_db",
           "outlier_operands", "quantize", "scale_bytes"]

GRANULARITIES = ("tensorwise", "rowwise", "blockwise", "mxfp8")
MX_ROUNDINGS = ("floor", "rceil")
AMAX_EPSILON = 1e-12
"""The smallest amax a scale divides by (torchao's ``EPS``): an all-zero block gets a finite scale."""
E8M0_BIAS = 127
E8M0_NAN = 255


@dataclasses.dataclass(frozen=True)
class FP8Granularity(Settings):
    """How finely an FP8 recipe scales its tensors (see the module docstring for each rule).

    Attributes:
      kind: ``"tensorwise"`` (today's default), ``"rowwise"``, ``"blockwise"`` or ``"mxfp8"``.
      pow2_scales: round scales down to powers of two (None: the kind's default: True for
        ``rowwise`` and ``blockwise``, False for ``tensorwise``; ``mxfp8`` always is).
      block: the ``blockwise`` tile (1 x block activations, block x block weights).
      mx_block: the ``mxfp8`` block length (32 in the OCP spec).
      mx_rounding: ``"floor"`` (OCP) or ``"rceil"`` (cuBLAS, Transformer Engine).
      weight_grad_hp: keep the weight-gradient matmul in high precision (torchao's
        ``rowwise_with_gw_hp``).
    """

    kind: str = "tensorwise"
    pow2_scales: bool | None = None
    block: int = 128
    mx_block: int = 32
    mx_rounding: str = "floor"
    weight_grad_hp: bool = False

    error: ClassVar[type[Exception]] = FP8ConfigError
    what: ClassVar[str] = "an FP8 granularity"

    def __post_init__(self) -> None:
        if self.kind not in GRANULARITIES:
            raise FP8ConfigError(f"FP8 granularity {self.kind!r} is invalid: must be one of {', '.join(GRANULARITIES)}")
        if self.pow2_scales not in (None, True, False):
            raise FP8ConfigError(f"pow2_scales={self.pow2_scales!r} must be True, False or None")
        for name in ("block", "mx_block"):
            value = getattr(self, name)
            if not is_int(value) or value < 1:
                raise FP8ConfigError(f"FP8Granularity.{name}={value!r} must be an integer >= 1")
        if self.mx_rounding not in MX_ROUNDINGS:
            raise FP8ConfigError(f"mx_rounding={self.mx_rounding!r} must be one of {', '.join(MX_ROUNDINGS)}")
        if not isinstance(self.weight_grad_hp, bool):
            raise FP8ConfigError(f"weight_grad_hp={self.weight_grad_hp!r} must be True or False")

    @classmethod
    def from_name(cls, name: str | None) -> FP8Granularity:
        """A granularity by its kind (``None``: ``tensorwise``)."""
        return cls() if name is None else cls(kind=name)

    @property
    def rounds_to_pow2(self) -> bool:
        """Whether scales are powers of two (the setting, or the kind's default)."""
        if self.kind == "mxfp8":
            return True
        if self.pow2_scales is None:
            return self.kind in ("rowwise", "blockwise")
        return self.pow2_scales

    def quantize(self, x: Any, fmt: Any = E4M3, *, axis: int = -1,
                 weight: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """:func:`quantize` with these settings."""
        return quantize(x, self.kind, fmt, axis=axis, weight=weight, pow2_scales=self.rounds_to_pow2,
                        block=self.block, mx_block=self.mx_block, mx_rounding=self.mx_rounding)


def block_shape(kind: str, ndim: int, *, weight: bool = False, block: int = 128, mx_block: int = 32) -> tuple[int, ...]:
    """The block of ``kind`` over an array of ``ndim`` dims whose contraction axis is last (0: the whole axis).

    ``tensorwise``: every axis whole; ``rowwise``: the last axis whole, one per row;
    ``blockwise``: ``block`` along the last axis (and the one before it for a weight);
    ``mxfp8``: ``mx_block`` along the last axis.
    """
    if kind == "tensorwise":
        return (0,) * ndim
    out = [1] * ndim
    if kind == "rowwise":
        out[-1] = 0
    elif kind == "blockwise":
        out[-1] = block
        if weight and ndim >= 2:
            out[-2] = block
    elif kind == "mxfp8":
        out[-1] = mx_block
    else:
        raise FP8ConfigError(f"FP8 granularity {kind!r} is invalid: must be one of {', '.join(GRANULARITIES)}")
    return tuple(out)


def _blocks(x: np.ndarray, shape: tuple[int, ...]) -> tuple[np.ndarray, tuple[int, ...]]:
    """``x`` zero-padded to whole blocks and viewed as ``(n0, b0, n1, b1, ...)``; the block sizes used."""
    sizes = tuple(n if b == 0 else min(b, n) if n else 1 for n, b in zip(x.shape, shape))
    pad = [(0, (-n) % b) for n, b in zip(x.shape, sizes)]
    padded = np.pad(x, pad) if any(p for _, p in pad) else x
    view = []
    for n, b in zip(padded.shape, sizes):
        view += [n // b, b]
    return padded.reshape(view), sizes


def _block_amax(x: np.ndarray, shape: tuple[int, ...]) -> tuple[np.ndarray, tuple[int, ...]]:
    blocked, sizes = _blocks(np.abs(x), shape)
    with np.errstate(invalid="ignore"):
        amax = blocked.max(axis=tuple(range(1, blocked.ndim, 2))) if blocked.size else np.zeros(
            tuple(blocked.shape[0::2]), np.float32)
    return amax.astype(np.float32), sizes


def _expand(values: np.ndarray, sizes: tuple[int, ...], shape: tuple[int, ...]) -> np.ndarray:
    for ax, b in enumerate(sizes):
        values = np.repeat(values, b, axis=ax)
    return values[tuple(slice(0, n) for n in shape)]


def _pow2_floor(scale: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.exp2(np.floor(np.log2(scale))).astype(np.float32)


def scale_bytes(shape: tuple[int, ...], granularity: str | FP8Granularity = "tensorwise", *, axis: int = -1,
                weight: bool = False) -> int:
    """Bytes of the scales one FP8 copy of a tensor of ``shape`` carries: 4 (float32) per tensor, row or
    block; 1 (an E8M0 exponent) per MX block of 32."""
    g = FP8Granularity.coerce(granularity)
    dims = list(shape)
    if dims:
        dims.append(dims.pop(axis % len(dims)))
    blocks = block_shape(g.kind, len(dims), weight=weight, block=g.block, mx_block=g.mx_block)
    count = 1
    for n, b in zip(dims, blocks):
        count *= 1 if b == 0 else -(-n // b)
    return count * (1 if g.kind == "mxfp8" else 4)


def current_scale(amax: Any, fmt: FP8Format, pow2: bool, epsilon: float = AMAX_EPSILON) -> np.ndarray:
    """``fmax / max(amax, epsilon)`` per block, in float64 then rounded to float32 (as torchao); powers
    of two rounded down when ``pow2``.  A NaN amax gives a NaN scale, an infinite one a zero scale."""
    amax64 = np.asarray(amax, np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        scale = (fmt.max / np.maximum(amax64, epsilon)).astype(np.float32)
    scale = np.where(np.isnan(amax64), np.float32(np.nan), scale)
    return _pow2_floor(scale) if pow2 else scale


def mx_exponent(amax: Any, fmt: FP8Format, rounding: str = "floor") -> np.ndarray:
    """The biased E8M0 exponent (uint8) of MX blocks with these amaxes (see the module docstring)."""
    amax = np.asarray(amax, np.float32)
    if rounding == "rceil":
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            descale = amax / np.float32(fmt.max)
            exp = np.clip(np.ceil(np.log2(descale)), -E8M0_BIAS, E8M0_BIAS) + E8M0_BIAS
        exp = np.where(np.isinf(descale), 254, np.where(np.isnan(descale), E8M0_NAN, np.nan_to_num(exp)))
        return exp.astype(np.uint8)
    if rounding != "floor":
        raise FP8ConfigError(f"mx_rounding={rounding!r} must be one of {', '.join(MX_ROUNDINGS)}")
    emax = int(np.floor(np.log2(fmt.max)))  # the largest power of two the format holds: 8 (e4m3), 15 (e5m2)
    pow2 = ((amax.view(np.int32) >> 23) & 0xFF).astype(np.int32) - E8M0_BIAS
    exp = np.clip(pow2 - emax, -E8M0_BIAS, E8M0_BIAS + 1) + E8M0_BIAS
    return np.where(np.isnan(amax), E8M0_NAN, exp).astype(np.uint8)


def _mx_multiplier(exp: np.ndarray, rounding: str, descale_nan: np.ndarray) -> np.ndarray:
    """What a block's data is multiplied by before the cast (the inverse of its MX scale)."""
    if rounding == "rceil":
        rcp = np.where(exp == 0, np.float32(1.0), np.exp2(E8M0_BIAS - exp.astype(np.float32)))
        rcp = np.where(exp == 254, np.float32(2.0**-127), rcp)
        return np.where(descale_nan, np.float32(np.nan), rcp).astype(np.float32)
    scale = (exp.astype(np.int32) << 23).view(np.float32)
    scale = np.maximum(scale, np.float32(2.0**-126))  # E8M0 0 would be a subnormal: clamped to the smallest normal
    with np.errstate(divide="ignore"):
        return (np.float32(1.0) / scale).astype(np.float32)


def quantize(x: Any, granularity: str = "tensorwise", fmt: Any = E4M3, *, axis: int = -1, weight: bool = False,
             pow2_scales: bool | None = None, block: int = 128, mx_block: int = 32, mx_rounding: str = "floor",
             epsilon: float = AMAX_EPSILON) -> tuple[np.ndarray, np.ndarray]:
    """``(q, scales)``: ``x`` cast to ``fmt`` with current scales at ``granularity`` (NumPy reference).

    ``axis`` is the matmul's contraction axis (rows are the slices across it); ``weight``: the
    tensor is a weight (``blockwise`` then tiles ``block x block``).  ``q`` has ``x``'s shape;
    ``scales`` has ``x``'s dims with each blocked axis as long as its block count (``x``'s
    layout, ``axis`` in place): float32 multipliers (``q = fp8(x * s)``), or for ``mxfp8``
    biased E8M0 exponents (``q = fp8(x / 2 ** (e - 127))``).
    """
    fmt = fp8_format(fmt)
    pow2 = granularity in ("rowwise", "blockwise") if pow2_scales is None else bool(pow2_scales)
    x32 = np.asarray(x, np.float32)
    moved = np.moveaxis(x32, axis, -1) if x32.ndim else x32.reshape(1)
    shape = block_shape(granularity, moved.ndim, weight=weight, block=block, mx_block=mx_block)
    amax, sizes = _block_amax(moved, shape)
    if granularity == "mxfp8":
        scales = mx_exponent(amax, fmt, mx_rounding)
        with np.errstate(invalid="ignore", divide="ignore"):
            nan_descale = np.isnan(amax / np.float32(fmt.max))
        factor = _mx_multiplier(scales, mx_rounding, nan_descale)
    else:
        scales = current_scale(amax, fmt, pow2, epsilon)
        factor = scales
    with np.errstate(over="ignore", invalid="ignore", under="ignore"):
        scaled = moved * _expand(factor, sizes, moved.shape)
    q = fp8_round(scaled, fmt, saturate=True)
    if x32.ndim == 0:
        return q.reshape(()), scales.reshape(())
    return np.moveaxis(q, -1, axis), np.moveaxis(scales, -1, axis)


def dequantize(q: Any, scales: Any, granularity: str = "tensorwise", *, axis: int = -1, weight: bool = False,
               block: int = 128, mx_block: int = 32) -> np.ndarray:
    """The float32 values ``(q, scales)`` of :func:`quantize` stand for: ``q / s``, or ``q * 2 ** (e - 127)``."""
    q32 = np.asarray(q, np.float32)
    moved_q = np.moveaxis(q32, axis, -1) if q32.ndim else q32.reshape(1)
    s = np.asarray(scales)
    moved_s = np.moveaxis(s, axis, -1) if s.ndim else s.reshape(1)
    shape = block_shape(granularity, moved_q.ndim, weight=weight, block=block, mx_block=mx_block)
    sizes = tuple(n if b == 0 else min(b, n) if n else 1 for n, b in zip(moved_q.shape, shape))
    full = _expand(moved_s, sizes, moved_q.shape)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        if granularity == "mxfp8":
            back = np.where(full == E8M0_NAN, np.float32(np.nan), np.exp2(full.astype(np.float32) - E8M0_BIAS))
            out = moved_q * back.astype(np.float32)
        else:
            out = moved_q / full.astype(np.float32)
    out = out.astype(np.float32)
    return out.reshape(()) if q32.ndim == 0 else np.moveaxis(out, -1, axis)


def matmul_snr_db(x: Any, w: Any, granularity: str = "tensorwise", fmt: Any = E4M3, **settings: Any) -> float:
    """How well ``fp8(x) @ fp8(w).T`` keeps ``x @ w.T`` at ``granularity``: the median over output rows of
    ``10 log10(|row|^2 / |row error|^2)`` (dB; higher is better), both operands cast along their
    contraction (last) axis, ``w`` as a weight.  ``settings``: :func:`quantize`'s keywords."""
    x32, w32 = np.asarray(x, np.float32), np.asarray(w, np.float32)
    xq = dequantize(*quantize(x32, granularity, fmt, **settings), granularity,
                    block=settings.get("block", 128), mx_block=settings.get("mx_block", 32))
    wq = dequantize(*quantize(w32, granularity, fmt, weight=True, **settings), granularity, weight=True,
                    block=settings.get("block", 128), mx_block=settings.get("mx_block", 32))
    ref = x32.astype(np.float64) @ w32.T.astype(np.float64)
    err = xq.astype(np.float64) @ wq.T.astype(np.float64) - ref
    with np.errstate(divide="ignore"):
        return float(10 * np.log10(np.median((ref**2).sum(1) / (err**2).sum(1))))


def outlier_operands(case: str, ratio: float, seed: int = 0, shape: tuple[int, int, int] = (64, 256, 128)
                     ) -> tuple[np.ndarray, np.ndarray]:
    """A stress pair ``(x, w)`` for :func:`matmul_snr_db`: ``case="channels"`` makes 3 input features
    ``ratio`` times the rest (as LLM activations) and their weights ``1/ratio`` (every channel then
    adds alike to the output); ``case="tokens"`` makes 2 rows of ``x`` ``ratio`` times the rest."""
    m, k, n = shape
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
    if case == "channels":
        channels = [3, 5, 17]
        x[:, channels] *= np.float32(ratio)
        w[:, channels] /= np.float32(ratio)
    elif case == "tokens":
        x[[2, m // 2]] *= np.float32(ratio)
    else:
        raise ValueError(f"case={case!r} must be 'channels' or 'tokens'")
    return x, w
