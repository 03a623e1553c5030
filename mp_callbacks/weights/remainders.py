"""Exact FP32 masters held as the bf16 weight plus a 16-bit remainder (``master_remainders``).

A bf16 number is the upper half of a float32's bits, so an FP32 master ``x``
(bits ``b``, 32 bits) is kept exactly as two 16-bit halves: the bf16 *forward
weight* ``w`` the model computes with, and the *remainder* ``r`` (int16)::

    r = low 16 bits of b, read as a signed int16
    w = (b >> 16) + (1 if r < 0 else 0)        mod 2**16   (bf16 bits)
    b = ((w - (1 if r < 0 else 0)) mod 2**16) << 16 | (r mod 2**16)      (join)

``join_master(split_master(x)) == x`` bit for bit for every float32 pattern (inf, NaN, -0
and subnormals included), so the masters and their updates are exactly those of
an FP32 copy: 2 + 2 bytes instead of 2 + 4.

Rounding of the forward weight: ``w`` is ``x`` rounded to the nearest bf16,
**ties away from zero** (``r < 0`` means the lower half is ``>= 0x8000``:
round the magnitude up).  A signed 16-bit remainder cannot hold
round-to-nearest-even, whose even results have 65,537 FP32 values rounding to
them (both ties).  So ``w`` equals torch's/XLA's ``x.to(bfloat16)`` except

* on exact ties that nearest-even rounds down to an even bf16 (lower half
  exactly ``0x8000`` and bit 16 clear): ``w`` is one bf16 ulp larger in
  magnitude (1 in 2**17 of uniformly distributed lower halves);
* on NaN: the upper half is kept as it is (a NaN whose payload lies only in
  the lower half reads as inf, or for patterns ``0x7FFF8000``-``0x7FFFFFFF``
  and their negatives as a zero); a master is NaN only when non-finite updates
  are let through (``skip_nonfinite=False``).

This is the split of Megatron-Core's ``store_param_remainders``
(Transformer Engine's ``FusedAdam``): upper half corrected by the remainder's
sign.  :func:`forward_half` / :func:`upper_half` are the rule over int16
arrays (NumPy, torch and Keras tensors: ``+``, ``-`` and an arithmetic ``>>``);
:func:`split_master` / :func:`join_master` are the NumPy reference on float32 values.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["forward_half", "join_master", "ties_differ", "split_master", "upper_half"]


def forward_half(upper: Any, lower: Any) -> Any:
    """The forward weight's bits (int16): ``upper - (lower >> 15)`` (``lower >> 15`` is -1 where ``lower < 0``).

    ``upper``/``lower``: the float32's upper and lower 16 bits as int16 arrays; arithmetic is mod ``2**16``.
    """
    return upper - (lower >> 15)


def upper_half(forward: Any, lower: Any) -> Any:
    """The float32's upper 16 bits (int16) from the forward weight's bits and remainder: ``forward + (lower >> 15)``."""
    return forward + (lower >> 15)


def split_master(x: Any) -> tuple[np.ndarray, np.ndarray]:
    """float32 ``x`` -> ``(forward weight bits as uint16, remainder as int16)`` (the reference)."""
    bits = np.ascontiguousarray(np.asarray(x, dtype=np.float32)).view(np.uint32)
    lower = (bits & np.uint32(0xFFFF)).astype(np.uint16).view(np.int16)
    upper = (bits >> np.uint32(16)).astype(np.uint16).view(np.int16)
    return forward_half(upper, lower).view(np.uint16), lower


def join_master(forward_bits: Any, remainder: Any) -> np.ndarray:
    """``(forward weight bits uint16, remainder int16)`` -> the exact float32 master (the reference)."""
    forward = np.asarray(forward_bits, dtype=np.uint16).view(np.int16)
    lower = np.asarray(remainder, dtype=np.int16)
    upper = upper_half(forward, lower).view(np.uint16).astype(np.uint32)
    return ((upper << np.uint32(16)) | lower.view(np.uint16).astype(np.uint32)).view(np.float32)


def ties_differ(x: Any) -> np.ndarray:
    """Where the forward weight of FP32 ``x`` differs from round-to-nearest-even (non-NaN ``x``):
    lower half exactly ``0x8000`` and bit 16 clear."""
    bits = np.ascontiguousarray(np.asarray(x, dtype=np.float32)).view(np.uint32)
    return ((bits & np.uint32(0x1FFFF)) == np.uint32(0x8000)) & ~np.isnan(np.asarray(x, dtype=np.float32))
