"""The random Hadamard transform (RHT) of NVFP4's weight-gradient operands.

The rule (Transformer Engine's ``NVFP4BlockScaling``; its reference ``_apply_rht``)
    ``H_d`` is the ``d x d`` Sylvester Hadamard matrix (``H_1 = [1]``,
    ``H_2n = [[H_n, H_n], [H_n, -H_n]]``; entries ±1, ``H_d H_d^T = d I``) and ``S`` the diagonal
    matrix of a sign vector ``s``.  The transform of a 2-D operand ``x`` (contraction axis last,
    its length a multiple of ``d``) multiplies every run of ``d`` consecutive elements along the
    last axis by ``R = S H_d / sqrt(d)`` (``x' = x R``).  ``R`` is orthogonal (``R R^T = I``), so
    ``x' y'^T = x y^T`` for two operands transformed alike: the weight-gradient matmul
    ``dW = dy^T x`` (contraction over the tokens) is unchanged in exact arithmetic while each
    operand's outliers are spread over ``d`` elements before the FP4 cast.  The inverse is
    ``x = x' R^T``.

The sign vector
    :data:`TE_SIGNS` (the default): the fixed 16 signs of Transformer Engine's
    ``get_wgrad_sign_vector``, shared by every layer for the whole run.  With a seed
    (:func:`rht_signs`), ``s_i = 1 - 2 * (mix32(mix32(seed) ^ i) >> 31)``: the project's
    counter-based hash (:func:`mp_callbacks.weights.mix32`), the same signs in every framework and
    never a draw from a global generator.

The arithmetic
    :func:`random_hadamard_transform` evaluates ``x R`` in float32 as the fast Walsh-Hadamard
    butterfly: multiply each element by its sign times ``f32(1 / sqrt(d))`` (the products a matmul
    with ``R`` forms; 1/4 for ``d = 16``), then for ``h = 1, 2, 4, ..., d/2`` replace each pair
    ``(u, v)`` of elements ``h`` apart (the first with bit ``h`` of its in-block index clear) by
    ``(u + v, u - v)``.  The order of the float32 additions is fixed, so every backend computes the
    same bits; it equals a matmul with ``R`` wherever the sums are exact in float32.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..weights import PY_INT_OPS, mix32
from .fp4 import NUMPY_NVFP4_OPS

TE_SIGNS = (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)
"""Transformer Engine's fixed RHT sign vector (``get_wgrad_sign_vector``), for ``d = 16``."""
RHT_SIZE = 16
"""The Hadamard size of NVFP4 (its block length)."""


def _check_size(size: int) -> int:
    if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < 1 or size & (size - 1):
        raise ValueError(f"the Hadamard size must be a power of two >= 1, got {size!r}")
    return int(size)


def rht_signs(seed: int | None = None, size: int = RHT_SIZE) -> tuple[int, ...]:
    """The RHT sign vector: :data:`TE_SIGNS` for ``seed=None`` (``size`` 16 only), else the seeded
    signs of the module docstring (``seed`` an integer >= 0)."""
    size = _check_size(size)
    if seed is None:
        if size != len(TE_SIGNS):
            raise ValueError(f"Transformer Engine's fixed signs are {len(TE_SIGNS)} long; give a seed for "
                             f"size {size}")
        return TE_SIGNS
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"the RHT seed must be an integer >= 0 or None, got {seed!r}")
    key = mix32(int(seed) & 0xFFFFFFFF, PY_INT_OPS)
    return tuple(1 - 2 * (mix32(key ^ i, PY_INT_OPS) >> 31) for i in range(size))


def hadamard_matrix(size: int = RHT_SIZE, signs: tuple[int, ...] | None = None,
                    normalized: bool = True) -> np.ndarray:
    """``S H_d`` (float64), divided by ``sqrt(d)`` when ``normalized``; ``signs=None``: ``S = I``."""
    size = _check_size(size)
    h = np.ones((1, 1))
    while h.shape[0] < size:
        h = np.block([[h, h], [h, -h]])
    if signs is not None:
        h = np.asarray(_check_signs(signs, size), dtype=np.float64)[:, None] * h
    return h / math.sqrt(size) if normalized else h


def _check_signs(signs: Any, size: int) -> tuple[int, ...]:
    signs = tuple(int(s) for s in signs)
    if len(signs) != size or any(s not in (1, -1) for s in signs):
        raise ValueError(f"the RHT signs must be {size} values of +1 or -1, got {signs!r}")
    return signs


def _butterfly(x: Any, size: int, ops: Any) -> Any:
    """``x @ H_d`` along the last axis of 2-D ``x`` (blocks of ``size``), in the fixed float32 order."""
    rows, cols = x.shape
    h = 1
    while h < size:
        v = ops.reshape(x, (rows, cols // (2 * h), 2, h))
        u, w = v[:, :, 0], v[:, :, 1]
        x = ops.reshape(ops.stack([ops.add(u, w), ops.add(u, ops.mul(w, ops.f32(-1.0)))], 2), (rows, cols))
        h *= 2
    return x


def _sign_row(signs: tuple[int, ...], cols: int, ops: Any) -> Any:
    """The signs times ``f32(1 / sqrt(d))``, repeated along a row of ``cols`` elements."""
    row = np.asarray(signs, dtype=np.float32) * np.float32(1.0 / math.sqrt(len(signs)))
    return ops.f32(np.tile(row, cols // len(signs)).reshape(1, cols))


def random_hadamard_transform(x: Any, signs: tuple[int, ...] = TE_SIGNS, ops: Any = NUMPY_NVFP4_OPS) -> Any:
    """``x R`` blockwise along the last axis of 2-D float32 ``x`` (the module docstring's rule); the
    Hadamard size is ``len(signs)`` and must divide ``x``'s last dimension."""
    size = _check_size(len(signs))
    signs = _check_signs(signs, size)
    rows, cols = x.shape
    if cols % size:
        raise ValueError(f"the RHT needs the last dimension ({cols}) to be a multiple of {size}; pad with zeros")
    return _butterfly(ops.mul(x, _sign_row(signs, cols, ops)), size, ops)


def inverse_random_hadamard_transform(y: Any, signs: tuple[int, ...] = TE_SIGNS, ops: Any = NUMPY_NVFP4_OPS) -> Any:
    """``y R^T`` (undoes :func:`random_hadamard_transform` up to float32 rounding): ``y`` times
    ``f32(1 / sqrt(d))``, the butterfly, then the signs."""
    size = _check_size(len(signs))
    signs = _check_signs(signs, size)
    rows, cols = y.shape
    if cols % size:
        raise ValueError(f"the RHT needs the last dimension ({cols}) to be a multiple of {size}; pad with zeros")
    x = _butterfly(ops.mul(y, ops.f32(1.0 / math.sqrt(size))), size, ops)
    return ops.mul(x, ops.f32(np.tile(np.asarray(signs, dtype=np.float32), cols // size).reshape(1, cols)))
