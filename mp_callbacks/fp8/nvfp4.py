"""The NVFP4 cast: E2M1 values with an E4M3 scale per block and an FP32 scale per tensor.

An operand is 2-D, ``(rows, cols)``, with the matmul's contraction axis last; a block is a
``1 x 16`` run along it (activations and gradients) or a ``16 x 16`` tile (weights, "2D"), and
every value is ``x ≈ q * s_block * s_tensor`` with ``q`` an E2M1 value (:mod:`.fp4`), ``s_block``
an E4M3 value and ``s_tensor = amax / (448 * 6)`` (float32, ``amax = max |x|`` over the operand:
torchao's ``per_tensor_amax_to_scale``, the decode scale both anchors' matmuls multiply by).

The block scale and the multiplier each element is rounded with, per ``rule`` (float32
arithmetic in this order; ``bmax`` = max ``|x|`` over the block; ``e4m3`` rounds to nearest even,
subnormals kept):

``"transformer-engine"`` (Transformer Engine's reference ``NVFP4QuantizerRef``; the default)::

    g_enc   = min(2688 / amax, FLT_MAX);  g_enc = 1 where g_enc == 0       (amax inf)
    g_dec   = 1 / g_enc
    s_block = e4m3(clip(min(bmax * (g_enc * f32(1/6)), FLT_MAX), -448, 448))
    enc     = min(1 / (s_block * g_dec), FLT_MAX)

``"torchao"`` (torchao's ``nvfp4_quantize`` with ``per_tensor_scale = amax / 2688``)::

    s_block = e4m3(clip((bmax / 6) / s_tensor, 2**-6, 448))
    enc     = (1 / s_tensor) / s_block

Single level (``two_level=False``, torchao's ``per_tensor_scale=None``; Transformer Engine has
none, its rule then runs with ``g_enc = g_dec = 1``): ``s_tensor = 1``; torchao's
``s_block = e4m3(clip(bmax / 6, 2**-6, 448))``, ``enc = 1 / s_block``.

Then ``q = fp4_round(x * enc)`` (clip to ±6, round to nearest even, or stochastically with
thresholds).  The two rules differ: torchao never lets a block scale fall below E4M3's smallest
normal ``2**-6`` while Transformer Engine keeps subnormal and zero block scales, and their float32
operations round differently.  A block is *finite* when its ``bmax``, ``s_block``, ``enc`` and
``s_tensor`` are all finite; a tensor holding inf or NaN, and under ``"torchao"`` an all-zero tensor (``0 / 0``) or
one so small that ``1 / s_tensor`` overflows, has non-finite blocks: the adapters skip such a step.
Zero blocks and a zero tensor cast to zeros under ``"transformer-engine"``.

Dequantization: ``(q * s_block) * s_tensor`` (Transformer Engine's order) or ``q * (s_tensor *
s_block)`` (torchao's ``get_hp_scales``).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from ..weights import NUMPY_ROUNDING_OPS, sr_thresholds
from .formats import E4M3, FLOAT32_MAX
from .fp4 import E2M1_MAX, NUMPY_NVFP4_OPS, fp4_round
from .hadamard import random_hadamard_transform

NVFP4_RULES = ("transformer-engine", "torchao")
"""The arithmetic of the block scales: Transformer Engine's reference or torchao's ``nvfp4_quantize``."""
NVFP4_BLOCK = 16
"""The NVFP4 block length (elements per E4M3 scale along the contraction axis)."""
TENSOR_SCALE_DIVISOR = E4M3.max * E2M1_MAX
"""``448 * 6 = 2688``: ``s_tensor = amax / 2688`` puts the largest block scale at E4M3's max."""
E4M3_MIN_NORMAL = E4M3.min_normal
"""``2**-6``: the smallest block scale torchao's rule allows (``torch.finfo(float8_e4m3fn).tiny``)."""


class NVFP4Cast(NamedTuple):
    """One operand cast to NVFP4 (backend arrays).

    Attributes:
      values: the E2M1 values (float32, the operand's shape; :func:`~mp_callbacks.fp8.fp4.fp4_codes`
        gives the codes).
      scales: the E4M3 block scales as float32, one per block: shape ``(rows / tile_rows, cols / 16)``
        (dims rounded up).
      tensor_scale: the float32 scalar ``s_tensor`` (1 for a single-level cast).
      amax: the float32 scalar amax the tensor scale came from.
      encode: the float32 multiplier of each block (``enc``), shaped like ``scales``.
      finite: per block, whether its amax, scale and multiplier are finite (bool, shaped like ``scales``).
    """

    values: Any
    scales: Any
    tensor_scale: Any
    amax: Any
    encode: Any
    finite: Any


def check_rule(rule: str) -> str:
    """``rule`` if it is one of :data:`NVFP4_RULES`, else a ``ValueError`` listing them."""
    if rule not in NVFP4_RULES:
        raise ValueError(f"NVFP4 scale rule {rule!r} is invalid: must be one of {', '.join(NVFP4_RULES)}")
    return rule


def check_tile(tile: Any) -> tuple[int, int]:
    """``(rows, cols)`` of a block: ``(1, n)`` or ``(n, n)`` with ``n`` a positive integer."""
    try:
        rows, cols = (int(t) for t in tile)
    except (TypeError, ValueError):
        raise ValueError(f"an NVFP4 tile must be (rows, cols), got {tile!r}") from None
    if cols < 1 or rows not in (1, cols):
        raise ValueError(f"an NVFP4 tile must be (1, n) or (n, n) with n >= 1, got {tile!r}")
    return rows, cols


def nvfp4_block_scales(amax: Any, bmax: Any, rule: str = "transformer-engine", two_level: bool = True,
                       ops: Any = NUMPY_NVFP4_OPS) -> tuple[Any, Any, Any]:
    """``(s_block, enc, s_tensor)`` for block amaxes ``bmax`` under ``rule`` (the module docstring)."""
    f = ops.f32
    s_tensor = ops.divide(ops.f32(amax), f(TENSOR_SCALE_DIVISOR)) if two_level else f(1.0)
    if check_rule(rule) == "torchao":
        ratio = ops.divide(bmax, f(E2M1_MAX))
        inv = f(1.0)
        if two_level:
            ratio = ops.divide(ratio, s_tensor)
            inv = ops.divide(f(1.0), s_tensor)
        s = ops.e4m3(ops.minimum(ops.maximum(ratio, f(E4M3_MIN_NORMAL)), f(E4M3.max)))
        return s, ops.divide(inv, s), s_tensor
    if two_level:
        g_enc = ops.minimum(ops.divide(f(TENSOR_SCALE_DIVISOR), ops.f32(amax)), f(FLOAT32_MAX))
        g_enc = ops.where(ops.less_equal(g_enc, f(0.0)), f(1.0), g_enc)
    else:
        g_enc = f(1.0)
    g_dec = ops.divide(f(1.0), g_enc)
    dec = ops.mul(bmax, ops.mul(g_enc, f(np.float32(1.0) / np.float32(E2M1_MAX))))
    dec = ops.minimum(dec, f(E4M3.max))  # min(dec, FLT_MAX) then clip to ±448: dec >= 0 (or NaN)
    s = ops.e4m3(dec)
    enc = ops.minimum(ops.divide(f(1.0), ops.mul(s, g_dec)), f(FLOAT32_MAX))
    return s, enc, s_tensor


def nvfp4_cast(x: Any, tile: tuple[int, int] = (1, NVFP4_BLOCK), rule: str = "transformer-engine",
               two_level: bool = True, amax: Any = None, thresholds: Any = None,
               ops: Any = NUMPY_NVFP4_OPS) -> NVFP4Cast:
    """Cast 2-D float32 ``x`` (dims multiples of ``tile``) to NVFP4 (the module docstring's rule).

    ``amax``: the tensor amax (default ``max |x|``; pass one already reduced over ranks).
    ``thresholds``: u32 stochastic-rounding thresholds below ``2**16`` in ``x``'s shape (None:
    round to nearest even).
    """
    rows, cols = check_tile(tile)
    amax = ops.max_abs(x) if amax is None else ops.f32(amax)
    bmax = ops.tile_max_abs(x, rows, cols)
    s, enc, s_tensor = nvfp4_block_scales(amax, bmax, rule, two_level, ops)
    q = fp4_round(ops.mul(x, ops.expand(enc, rows, cols)), ops, thresholds)
    finite = ops.logical_and(ops.logical_and(ops.isfinite(bmax), ops.isfinite(s)), ops.isfinite(enc))
    finite = ops.logical_and(finite, ops.isfinite(s_tensor))
    return NVFP4Cast(q, s, s_tensor, amax, enc, finite)


def nvfp4_quantize(x: Any, tile: tuple[int, int] = (1, NVFP4_BLOCK), rule: str = "transformer-engine",
                   two_level: bool = True, amax: Any = None, signs: tuple[int, ...] | None = None,
                   sr_key: int | None = None, ops: Any = NUMPY_NVFP4_OPS,
                   rounding_ops: Any = NUMPY_ROUNDING_OPS) -> NVFP4Cast:
    """Cast a 2-D operand of any shape: zero-padded to whole tiles, optionally transformed, cast, the values
    cropped back.

    ``signs``: apply the random Hadamard transform with these signs first (:mod:`.hadamard`; the last
    dimension must then be a multiple of ``len(signs)``, and the amax is the transformed operand's).
    ``sr_key``: round stochastically with the thresholds ``sr_thresholds(sr_key, i)``, ``i`` the
    row-major index in the padded operand (:func:`mp_callbacks.weights.sr_thresholds`, drawn with
    ``rounding_ops``); None rounds to nearest even.
    """
    rows, cols = check_tile(tile)
    m, k = x.shape
    if signs is not None:
        x = random_hadamard_transform(x, tuple(signs), ops)
    padded = ops.pad_to(x, rows, cols)
    thresholds = None
    if sr_key is not None:
        thresholds = sr_thresholds(sr_key, rounding_ops.index(padded), rounding_ops)
    cast = nvfp4_cast(padded, (rows, cols), rule, two_level, amax, thresholds, ops)
    return cast._replace(values=ops.crop(cast.values, m, k))


def nvfp4_dequantize(cast: NVFP4Cast, tile: tuple[int, int] = (1, NVFP4_BLOCK), rule: str = "transformer-engine",
                     ops: Any = NUMPY_NVFP4_OPS) -> Any:
    """The float32 values a cast stands for: ``(q * s_block) * s_tensor`` (``"torchao"``:
    ``q * (s_tensor * s_block)``)."""
    rows, cols = check_tile(tile)
    m, k = cast.values.shape
    s = ops.crop(ops.expand(cast.scales, rows, cols), m, k)
    if check_rule(rule) == "torchao":
        return ops.mul(cast.values, ops.mul(s, cast.tensor_scale))
    return ops.mul(ops.mul(cast.values, s), cast.tensor_scale)


# -- what a monitor reports (NumPy) ------------------------------------------------------------------


def _per_element(a: Any, shape: tuple[int, ...], tile: tuple[int, int]) -> np.ndarray:
    rows, cols = check_tile(tile)
    return np.repeat(np.repeat(np.asarray(a, np.float32), rows, 0), cols, 1)[: shape[0], : shape[1]]


def nvfp4_saturated_fraction(x: Any, cast: NVFP4Cast, tile: tuple[int, int] = (1, NVFP4_BLOCK)) -> float:
    """Share of the elements of ``x`` (the operand ``cast`` was made from, after any transform) that the cast
    clipped: scaled magnitude ``|x * enc|`` above 6, the E2M1 max, in a block whose scale is not zero (NaN
    does not count)."""
    x = np.asarray(x, dtype=np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        scaled = x * _per_element(cast.encode, x.shape, tile)
    mask = (np.abs(scaled) > E2M1_MAX) & (_per_element(cast.scales, x.shape, tile) != 0)
    return float(mask.mean()) if x.size else 0.0


def nvfp4_flushed_fraction(x: Any, cast: NVFP4Cast, tile: tuple[int, int] = (1, NVFP4_BLOCK)) -> float:
    """Share of the elements of ``x`` that are non-zero but stand for zero after the cast: their E2M1 value
    is 0 (``|x * enc| <= 0.25`` under round to nearest even; the draw decides under stochastic rounding)
    or their block scale is (below half E4M3's smallest subnormal)."""
    x = np.asarray(x, dtype=np.float32)
    zero = (np.asarray(cast.values) == 0) | (_per_element(cast.scales, x.shape, tile) == 0)
    flushed = (x != 0) & ~np.isnan(x) & zero
    return float(flushed.mean()) if x.size else 0.0
