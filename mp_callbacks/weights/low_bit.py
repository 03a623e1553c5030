"""8-bit block-quantized optimizer states (``state_dtype="8bit"``): the rule both adapters store Adam's m and v by.

The layout is torchao's ``AdamW8bit`` (after Dettmers et al., https://arxiv.org/abs/2110.02861):

* a state tensor of at least :data:`MIN_NUMEL` elements and a multiple of :data:`BLOCK_SIZE` (256) is held
  as one ``uint8`` code per element plus one float32 scale per block of 256 consecutive (row-major)
  elements; any other state tensor stays plain FP32;
* ``scale = max(max|x| over the block, 1e-12)``; ``y = x / scale`` (float32, in ``[-1, 1]``);
* the code is the index of the nearest entry of a 256-entry map (:func:`dynamic_map`): with ``lo`` the
  largest index whose entry is ``<= y`` (0 below the first) and ``hi = min(lo + 1, 255)``, the code is
  ``hi`` when ``y - map[lo] >= (map[hi] - map[lo]) * 0.5`` (float32; a tie rounds up), else ``lo``;
* the value a code stands for is ``map[code] * scale`` (float32).

The map is the dynamic-tree map: for each decade ``d = 0..6`` the interval ``[0.1, 1] * 10**(d-6)`` is cut
into ``n_d`` equal parts and each part contributes its midpoint; ``n_d = 2**d`` for m (signed: the
midpoints and their negatives) and ``2**(d+1)`` for v (unsigned); 0 and 1 complete 256 entries.  In
float32 as torchao builds it: the cut points ``0.1 + j * step`` (``step = (1 - 0.1) / n_d``, float32)
are rounded once (a fused multiply-add: torch's float32 ``linspace``), the midpoints are
``(a + b) / 2`` and the decade factor ``float32(10**(d-6))`` multiplies them in float32.

The Adam step over quantized states (:func:`adam_step_8bit`) is torchao's: dequantize, ``m = lerp_8bit(m, g, 1-b1)``,
``v = lerp_8bit(v, g*g, 1-b2)``, store both requantized, and update the weight from the *unquantized*
FP32 m and v of this step.  Every function is written over :class:`QuantOps`; :data:`NUMPY_QUANT_OPS` is
the reference.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any, Protocol, runtime_checkable

import numpy as np

STATE_8BIT = "8bit"
"""The ``MasterPlan.state_dtype`` of block-quantized 8-bit optimizer states."""

BLOCK_SIZE = 256
"""Elements per quantization block (one float32 scale each)."""

MIN_NUMEL = 4096
"""The smallest state tensor that is quantized (smaller ones stay FP32, as in bitsandbytes and torchao)."""

SCALE_FLOOR = 1e-12
"""The smallest block scale (an all-zero block divides by it)."""

CODES = 256
"""Entries of the quantization map (8-bit codes)."""


def quantizes(numel: int, block_size: int = BLOCK_SIZE) -> bool:
    """Whether a state tensor of ``numel`` elements is held block-quantized."""
    return numel >= MIN_NUMEL and numel % block_size == 0


def _cut_points(parts: int) -> np.ndarray:
    """``parts + 1`` float32 points from 0.1 to 1, each ``0.1 + j * step`` rounded once (torch's float32
    ``linspace``: the first half from 0.1 up, the second from 1 down)."""
    start = np.float32(0.1)
    step = (np.float32(1.0) - start) / np.float32(parts)
    j = np.arange(parts + 1, dtype=np.float64)  # step * j is exact in float64: one rounding at the end
    up = np.float64(start) + np.float64(step) * j
    down = 1.0 - np.float64(step) * (parts - j)
    return np.where(j < (parts + 1) // 2, up, down).astype(np.float32)


@lru_cache(maxsize=2)
def _dynamic_map(signed: bool) -> bytes:
    values = [np.float32(0.0), np.float32(1.0)]
    for d in range(7):
        cuts = _cut_points(2 ** d if signed else 2 ** (d + 1))
        mids = (cuts[:-1] + cuts[1:]) / np.float32(2.0)
        factor = np.float32(10.0 ** (d - 6))
        values += list(factor * mids)
        if signed:
            values += list(-factor * mids)
    table = np.sort(np.asarray(values, dtype=np.float32))
    assert table.size == CODES and np.unique(table).size == CODES
    return table.tobytes()


def dynamic_map(signed: bool) -> np.ndarray:
    """The 256 float32 entries (sorted ascending) codes index: signed for Adam's m, unsigned for v."""
    return np.frombuffer(_dynamic_map(bool(signed)), dtype=np.float32).copy()


@runtime_checkable
class QuantOps(Protocol):
    """Array operations the quantization rule and the Adam step are written in (float32 and int32 arrays;
    a scalar argument may be a Python number)."""

    def f32(self, x: Any) -> Any:
        """``x`` as a float32 array (a Python number: a float32 scalar)."""

    def blocks(self, x: Any, block_size: int) -> Any:
        """``x`` reshaped to ``(numel // block_size, block_size)`` (row-major)."""

    def reshape_like(self, x: Any, like: Any) -> Any:
        """``x`` reshaped to ``like``'s shape."""

    def row_absmax(self, xb: Any) -> Any:
        """``max |x|`` of each row of a 2-d array (NaN propagates)."""

    def div_rows(self, xb: Any, s: Any) -> Any:
        """Each row of ``xb`` divided by its entry of ``s``."""

    def mul_rows(self, xb: Any, s: Any) -> Any:
        """Each row of ``xb`` times its entry of ``s``."""

    def maximum(self, a: Any, b: Any) -> Any:
        """Elementwise maximum."""

    def ge(self, a: Any, b: Any) -> Any:
        """``a >= b``."""

    def where(self, cond: Any, a: Any, b: Any) -> Any:
        """``a`` where ``cond`` else ``b``."""

    def take(self, table: Any, index: Any) -> Any:
        """``table[index]`` (``index``: int32 array)."""

    def zeros_i32(self, like: Any) -> Any:
        """int32 zeros of ``like``'s shape."""

    def add(self, a: Any, b: Any) -> Any:
        """``a + b`` (int32 + Python int, or float32)."""

    def sub(self, a: Any, b: Any) -> Any:
        """``a - b`` (float32)."""

    def mul(self, a: Any, b: Any) -> Any:
        """``a * b`` (float32)."""

    def div(self, a: Any, b: Any) -> Any:
        """``a / b`` (float32)."""

    def sqrt(self, a: Any) -> Any:
        """Square root (float32)."""

    def pow(self, base: float, exponent: Any) -> Any:
        """``float32(base) ** exponent`` (``exponent``: a float32 scalar)."""

    def to_codes(self, index: Any) -> Any:
        """int32 indices in ``[0, 255]`` as uint8 codes."""

    def from_codes(self, codes: Any) -> Any:
        """uint8 codes as int32 indices."""


def quantize_8bit(x: Any, table: Any, ops: Any, block_size: int = BLOCK_SIZE) -> tuple[Any, Any]:
    """FP32 state ``x`` -> ``(codes, scales)``: uint8 codes of ``x``'s shape, one float32 scale per block."""
    xb = ops.blocks(ops.f32(x), block_size)
    scale = ops.maximum(ops.row_absmax(xb), ops.f32(SCALE_FLOOR))
    y = ops.reshape_like(ops.div_rows(xb, scale), x)
    lo = ops.zeros_i32(y)
    for step in (128, 64, 32, 16, 8, 4, 2, 1):  # branchless search: the largest entry <= y
        up = ops.add(lo, step)
        lo = ops.where(ops.ge(y, ops.take(table, up)), up, lo)
    hi = ops.add(lo, 1)
    hi = ops.where(ops.ge(hi, CODES), lo, hi)
    below, above = ops.take(table, lo), ops.take(table, hi)
    codes = ops.where(ops.ge(ops.sub(y, below), ops.mul(ops.sub(above, below), ops.f32(0.5))), hi, lo)
    return ops.to_codes(codes), scale


def dequantize_8bit(codes: Any, scale: Any, table: Any, ops: Any) -> Any:
    """``map[code] * scale`` per element (float32, ``codes``' shape)."""
    values = ops.take(table, ops.from_codes(codes))
    block_size = _numel(codes) // _numel(scale)
    return ops.reshape_like(ops.mul_rows(ops.blocks(values, block_size), scale), codes)


def _numel(a: Any) -> int:
    n = 1
    for d in a.shape:
        n *= int(d)
    return n


def lerp_8bit(a: Any, b: Any, weight: float, ops: Any) -> Any:
    """``a + w * (b - a)`` for ``w < 0.5``, else ``b - (b - a) * (1 - w)`` (torch's ``lerp``, float32)."""
    w = np.float32(weight)
    if abs(float(w)) < 0.5:
        return ops.add(a, ops.mul(ops.f32(float(w)), ops.sub(b, a)))
    return ops.sub(b, ops.mul(ops.sub(b, a), ops.f32(float(np.float32(1.0) - w))))


def adam_step_8bit(param: Any, grad: Any, m: Any, v: Any, step: Any, *, lr: float, beta1: float, beta2: float,
              eps: float, weight_decay: float, decoupled: bool, ops: Any) -> tuple[Any, Any, Any]:
    """One Adam(W) step in float32 on dequantized states: ``(param', m', v')``, ``m'`` and ``v'`` unquantized
    (the caller stores them with :func:`quantize_8bit`; the weight update uses them as they are).

    ``step`` is this step's count (1 on the first), a float32 scalar; ``decoupled``: AdamW's decay
    ``p -= lr * wd * p`` (else Adam's ``g += wd * p``)."""
    p, g = ops.f32(param), ops.f32(grad)
    if decoupled:
        p = ops.sub(p, ops.mul(ops.mul(ops.f32(lr), ops.f32(weight_decay)), p))
    elif weight_decay:
        g = ops.add(g, ops.mul(ops.f32(weight_decay), p))
    bc1 = ops.sub(ops.f32(1.0), ops.pow(beta1, step))
    bc2 = ops.sub(ops.f32(1.0), ops.pow(beta2, step))
    m = lerp_8bit(ops.f32(m), g, 1.0 - beta1, ops)
    v = lerp_8bit(ops.f32(v), ops.mul(g, g), 1.0 - beta2, ops)
    denom = ops.add(ops.div(ops.sqrt(v), ops.sqrt(bc2)), ops.f32(eps))
    p = ops.sub(p, ops.div(ops.mul(ops.f32(lr), ops.div(m, bc1)), denom))
    return p, m, v


class NumpyQuantOps:
    """Reference backend: NumPy float32/int32/uint8 arrays (each method as :class:`QuantOps` documents)."""

    def f32(self, x: Any) -> np.ndarray:
        return np.asarray(x, dtype=np.float32)

    def blocks(self, x, block_size):
        return np.asarray(x).reshape(-1, block_size)

    def reshape_like(self, x, like):
        return np.asarray(x).reshape(np.shape(like))

    def row_absmax(self, xb):
        return np.max(np.abs(xb), axis=-1)

    def div_rows(self, xb, s):
        return (xb / s[:, None]).astype(np.float32)

    def mul_rows(self, xb, s):
        return (xb * s[:, None]).astype(np.float32)

    def maximum(self, a, b):
        return np.maximum(a, b)

    def ge(self, a, b):
        return np.greater_equal(a, b)

    def where(self, cond, a, b):
        return np.where(cond, a, b)

    def take(self, table, index):
        return np.asarray(table, dtype=np.float32)[np.asarray(index)]

    def zeros_i32(self, like):
        return np.zeros(np.shape(like), dtype=np.int32)

    def add(self, a, b):
        a = np.asarray(a)
        return (a + np.asarray(b, dtype=a.dtype)).astype(a.dtype)

    def sub(self, a, b):
        return np.subtract(a, b, dtype=np.float32)

    def mul(self, a, b):
        return np.multiply(a, b, dtype=np.float32)

    def div(self, a, b):
        return np.divide(a, b, dtype=np.float32)

    def sqrt(self, a):
        return np.sqrt(np.asarray(a, dtype=np.float32))

    def pow(self, base, exponent):
        return np.power(np.float32(base), np.asarray(exponent, dtype=np.float32))

    def to_codes(self, index):
        return np.asarray(index).astype(np.uint8)

    def from_codes(self, codes):
        return np.asarray(codes).astype(np.int32)


NUMPY_QUANT_OPS = NumpyQuantOps()
"""The shared instance of the reference backend."""

__all__ = [
    "BLOCK_SIZE", "CODES", "MIN_NUMEL", "NUMPY_QUANT_OPS", "NumpyQuantOps", "QuantOps", "SCALE_FLOOR",
    "STATE_8BIT", "adam_step_8bit", "dequantize_8bit", "dynamic_map", "lerp_8bit", "quantize_8bit", "quantizes",
]
