"""Update rounding without FP32 masters: the rules of ``bf16-kahan`` and ``bf16-sr``.

The weights live in the storage dtype (bf16); the optimizer computes its new
value of a weight in FP32 (``t_new``, from FP32 states); a rule writes it back:

Kahan compensation (``bf16-kahan``)
    Every weight ``w`` has a compensation buffer ``c`` in the storage dtype
    (the part of past updates the weight could not hold; the weight the
    optimizer sees is ``t = f32(w) + f32(c)``).  With ``u`` the optimizer's
    FP32 update, in the working precision (each operation on two
    storage-dtype values is computed in float32 and rounded once, to nearest
    even, to the storage dtype: what torch and XLA do for bf16 arithmetic)::

        u   = t_new - (f32(w) + f32(c))          # float32
        y   = low(u) + c                          # update plus carried compensation
        new = w + y
        c'  = y - (new - w)                       # what ``new`` could not hold

    :func:`kahan_add` is the rule over ``u``, :func:`kahan_apply` over ``t_new``.
    An FP32 value ``x`` rounded to the storage dtype starts with
    ``c = low(x - f32(low(x)))`` (:func:`initial_compensation`).

Stochastic rounding (``bf16-sr``), FP32 -> bf16
    A bf16 number is the upper half of a float32's bits.  With ``r`` a
    threshold uniform in ``[0, 2**16)``::

        bits = float32 bits of x                  # uint32
        sr(x) = the bf16 whose bits are the upper 16 bits of (bits + r) mod 2**32

    rounds ``|x|`` up with probability (lower 16 bits)/2**16 and down
    otherwise, so ``E[sr(x)] = x`` exactly for a uniform ``r`` (NaN stays NaN;
    inf stays inf).

The random source and the element layout (so that both adapters draw the same
number for corresponding elements) are :mod:`mp_callbacks.weights.random_source`
(re-exported here).

Every rule is written once over :class:`RoundingOps` (elementwise arrays)
and evaluated by :class:`NumpyRoundingOps` (the reference), by the torch
adapter and by ``keras.ops``.  :data:`PY_INT_OPS` evaluates the integer part
on Python integers (the keys).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np

from ..dtypes import canonical_dtype
from ..settings import StateDictError
from .random_source import (
    MASK32,
    sr_key,
    sr_thresholds,
)

ROUNDING_MODES = ("nearest", "kahan", "stochastic")
"""How an update is written into a weight: ``nearest`` (the storage dtype's
rounding, or an FP32 master), ``kahan`` (compensation buffer), ``stochastic``."""

ROUNDING_SCHEMA_VERSION = 1
"""Version of the update-rounding checkpoint record (:func:`make_rounding_state`)."""


def check_mode(mode: Any) -> str:
    """``mode`` if it is one of :data:`ROUNDING_MODES`, else a ``ValueError`` listing them."""
    if mode not in ROUNDING_MODES:
        raise ValueError(f"update_rounding={mode!r} is invalid; valid: {', '.join(ROUNDING_MODES)}")
    return mode


@runtime_checkable
class RoundingOps(Protocol):
    """Elementwise operations the rounding rules are written in.

    Float arrays are float32 or the storage dtype; ``u32`` arrays hold
    unsigned 32-bit integers (a backend may store the same bits in int32);
    integer arithmetic is modulo ``2**32``.  Nothing converts to host values.
    ``xor``, ``mul``, ``add_u32`` and ``bf16_from_bits`` may
    overwrite their first argument when it is an array (the rules pass only
    their own temporaries there and never read them again), so a backend can
    work in place.
    """

    def to_f32(self, a: Any) -> Any:
        """``a`` as float32 (exact for storage-dtype values)."""

    def to_like(self, x: Any, like: Any) -> Any:
        """float32 ``x`` rounded to nearest even in ``like``'s dtype."""

    def add(self, a: Any, b: Any) -> Any:
        """``a + b`` (same dtype): computed in float32, rounded once to their dtype."""

    def sub(self, a: Any, b: Any) -> Any:
        """``a - b`` (same dtype): computed in float32, rounded once to their dtype."""

    def isnan(self, a: Any) -> Any:
        """True where ``a`` is NaN."""

    def where(self, cond: Any, a: Any, b: Any) -> Any:
        """``a`` where ``cond`` else ``b`` (either may be a scalar of the other's dtype)."""

    def u32(self, value: Any) -> Any:
        """A u32 constant (a Python int in ``[0, 2**32)``) or array."""

    def index(self, like: Any) -> Any:
        """u32 row-major flat element indices ``0 .. numel-1`` in ``like``'s shape."""

    def xor(self, a: Any, b: Any) -> Any:
        """Bitwise xor of u32 values."""

    def shr(self, a: Any, k: int) -> Any:
        """Logical right shift of u32 ``a`` by ``k`` bits (zeros enter from the left)."""

    def mul(self, a: Any, k: int) -> Any:
        """``a * k mod 2**32`` (``k`` a Python int constant)."""

    def add_u32(self, a: Any, b: Any) -> Any:
        """``a + b mod 2**32``."""

    def f32_bits(self, x: Any) -> Any:
        """The bits of float32 ``x`` as u32."""

    def bf16_from_bits(self, bits: Any) -> Any:
        """The bf16 whose bits are the upper half of u32 ``bits`` (the lower half is dropped; an array,
        or a Python int: a scalar)."""


BF16_NAN_BITS = 0x7FC00000
"""The float32 bits whose upper half is the bf16 NaN a NaN rounds to (``0x7FC0``, torch's and XLA's)."""


def round_with_thresholds(x: Any, thresholds: Any, ops: Any) -> Any:
    """Stochastic rounding of float32 ``x`` to bf16 with thresholds in ``[0, 2**16)`` (NaN -> bf16 ``0x7FC0``).

    ``thresholds`` is consumed (a backend may overwrite it).
    """
    low = ops.bf16_from_bits(ops.add_u32(thresholds, ops.f32_bits(x)))
    return ops.where(ops.isnan(x), ops.bf16_from_bits(ops.u32(BF16_NAN_BITS)), low)


def stochastic_round(x: Any, key: Any, ops: Any, index: Any = None) -> Any:
    """float32 ``x`` rounded stochastically to bf16 with the draws of ``key`` (:func:`sr_key`).

    ``index``: the u32 flat indices of ``x``'s elements (default: row-major
    ``0 .. numel-1``, :meth:`RoundingOps.index`).
    """
    if index is None:
        index = ops.index(x)
    return round_with_thresholds(x, sr_thresholds(key, index, ops), ops)


# ------------------------------------------------------------------- Kahan
def kahan_add(w: Any, c: Any, u: Any, ops: Any) -> tuple[Any, Any]:
    """Add FP32 update ``u`` to weight ``w`` with compensation ``c`` (both storage dtype).

    ``y = low(u) + c; new = w + y; c' = y - (new - w)``, each operation
    rounded to the storage dtype.  Returns ``(new, c')``.
    """
    y = ops.add(ops.to_like(u, w), c)
    new = ops.add(w, y)
    return new, ops.sub(y, ops.sub(new, w))


def kahan_apply(w: Any, c: Any, t_new: Any, ops: Any) -> tuple[Any, Any]:
    """Write the optimizer's FP32 result ``t_new`` (it updated ``f32(w) + f32(c)``) back as ``(w', c')``."""
    u = ops.sub(t_new, ops.add(ops.to_f32(w), ops.to_f32(c)))
    return kahan_add(w, c, u, ops)


def initial_compensation(x: Any, w: Any, ops: Any) -> Any:
    """The compensation of FP32 ``x`` stored as ``w = low(x)``: ``low(x - f32(w))``."""
    return ops.to_like(ops.sub(x, ops.to_f32(w)), w)


def compensated_value(w: Any, c: Any, ops: Any) -> Any:
    """The weight the optimizer updates under Kahan: ``f32(w) + f32(c)``."""
    return ops.add(ops.to_f32(w), ops.to_f32(c))


# ------------------------------------------------------------- NumPy reference
def bf16_bits(x: Any) -> np.ndarray:
    """float32 -> bf16 bits (uint16), round to nearest even, NaN -> ``0x7FC0`` (torch's ``c10::BFloat16`` rule)."""
    x = np.ascontiguousarray(np.asarray(x, dtype=np.float32))
    b = x.view(np.uint32).astype(np.uint64)
    rounded = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(np.isnan(x), np.uint16(0x7FC0), rounded).astype(np.uint16)


def bf16_to_f32(bits: Any) -> np.ndarray:
    """bf16 bits (uint16) -> float32 (exact)."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


class NumpyRoundingOps:
    """Reference backend: float32 arrays, bf16 as ``uint16`` bit arrays, float16 as ``np.float16``, u32 as
    ``np.uint32``.

    Each method does what the same-named :class:`RoundingOps` method documents.
    """

    @staticmethod
    def _low(a: np.ndarray) -> str:
        return "bfloat16" if a.dtype == np.uint16 else str(a.dtype)

    def to_f32(self, a):
        a = np.asarray(a)
        return bf16_to_f32(a) if a.dtype == np.uint16 else a.astype(np.float32)

    def to_like(self, x, like):
        x, like = np.asarray(x, dtype=np.float32), np.asarray(like)
        if like.dtype == np.uint16:
            return bf16_bits(x)
        return x.astype(like.dtype)

    def _binary(self, a, b, op):
        a, b = np.asarray(a), np.asarray(b)
        with np.errstate(over="ignore", invalid="ignore"):
            out = op(self.to_f32(a), self.to_f32(b)).astype(np.float32)
        return self.to_like(out, a)

    def add(self, a, b):
        return self._binary(a, b, np.add)

    def sub(self, a, b):
        return self._binary(a, b, np.subtract)

    def isnan(self, a):
        return np.isnan(self.to_f32(a))

    def where(self, cond, a, b):
        a, b = np.asarray(a), np.asarray(b)
        return np.where(cond, a, b)

    def u32(self, value):
        return np.asarray(np.asarray(value, dtype=np.uint64) & MASK32, dtype=np.uint32)

    def index(self, like):
        like = np.asarray(like)
        return np.arange(like.size, dtype=np.uint32).reshape(like.shape)

    def xor(self, a, b):
        return np.bitwise_xor(self.u32(a), self.u32(b))

    def shr(self, a, k):
        return np.right_shift(self.u32(a), np.uint32(k))

    def mul(self, a, k):
        return self.u32(self.u32(a).astype(np.uint64) * np.uint64(k & MASK32))

    def add_u32(self, a, b):
        return self.u32(self.u32(a).astype(np.uint64) + self.u32(b).astype(np.uint64))

    def f32_bits(self, x):
        return np.ascontiguousarray(np.asarray(x, dtype=np.float32)).view(np.uint32)

    def bf16_from_bits(self, bits):
        return (self.u32(bits) >> np.uint32(16)).astype(np.uint16)


NUMPY_ROUNDING_OPS = NumpyRoundingOps()
"""The shared instance of the reference backend."""


# ------------------------------------------------------------- plan and state
@dataclass(frozen=True)
class RoundingStream:
    """The stochastic-rounding stream: a seed and the count of updates drawn so far.

    Draws of update ``counter`` for tensor ``t`` use ``sr_key(seed, t, counter)``;
    :meth:`advance` after every applied update (never on a skipped step).
    """

    seed: int = 0
    counter: int = 0

    def __post_init__(self) -> None:
        for name in ("seed", "counter"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
                raise ValueError(f"stochastic rounding {name}={value!r} must be an integer >= 0")
        object.__setattr__(self, "seed", int(self.seed))
        object.__setattr__(self, "counter", int(self.counter))

    def key(self, tensor_index: int) -> int:
        """The key of tensor ``tensor_index`` at this update."""
        return sr_key(self.seed, tensor_index, self.counter)

    def advance(self) -> RoundingStream:
        """The stream after one applied update."""
        return RoundingStream(self.seed, self.counter + 1)


def make_rounding_state(mode: str, stream: RoundingStream, storage: str) -> dict[str, Any]:
    """The plain-data checkpoint record of the rounding state (adapters add their ``compensation`` buffers)."""
    return {"schema_version": ROUNDING_SCHEMA_VERSION, "mode": check_mode(mode), "storage": canonical_dtype(storage),
            "seed": stream.seed, "counter": stream.counter}


def read_rounding_state(mode: str, state: Mapping[str, Any] | None) -> RoundingStream:
    """Check a :func:`make_rounding_state` record against ``mode``; returns its stream.

    A missing record, another schema version or another mode is a
    :class:`~mp_callbacks.loss_scale.scaler.StateDictError` naming both.
    """
    if not isinstance(state, Mapping):
        raise StateDictError(f"the checkpoint holds no update-rounding state (got {type(state).__name__}); "
                             f"this run rounds updates with {mode!r}")
    version = state.get("schema_version")
    if version != ROUNDING_SCHEMA_VERSION:
        raise StateDictError(f"the checkpoint's update-rounding state has schema v{version!r}; "
                             f"this run reads v{ROUNDING_SCHEMA_VERSION}")
    if state.get("mode") != mode:
        raise StateDictError(f"the checkpoint rounds updates with {state.get('mode')!r}; this run with {mode!r}")
    try:
        return RoundingStream(int(state["seed"]), int(state["counter"]))
    except (KeyError, TypeError, ValueError) as exc:
        raise StateDictError(f"the checkpoint's update-rounding state is corrupt: {exc}") from None
