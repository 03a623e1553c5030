"""The rules behind the diagnostics meters, with NumPy reference implementations.

Adapters evaluate the same rules on their own tensors and are tested against
the references here.

Gradient underflow (``mp/grad_underflow_frac``)
    Share of the non-zero FP32 (unscaled) gradient elements ``g`` that would
    flush to zero in the compute dtype at the current scale:
    ``|g| * scale < smallest_subnormal(compute) / 2``.

Update swamping (``mp/update_swamped_frac``)
    Share of non-zero parameter updates ``d`` that are lost when added to a
    weight ``w`` stored in the storage dtype (the "1.0 + 1e-5 stays 1.0 in
    bf16" effect): ``|d| < ulp(w) / 2`` where ``ulp(w) = 2**(e - mantissa_bits)``
    for ``|w|`` in ``[2**e, 2**(e+1))`` (subnormal weights use the subnormal
    spacing).  These are the updates that master weights keep.

Sampling (both fraction meters)
    A share does not need every element: a meter reads at most ``samples``
    elements of each tensor, elements ``0, s, 2s, ...`` of the flattened tensor
    with the stride of :func:`sample_stride`, so its cost on a logging step is
    bounded per tensor instead of growing with the model.  ``samples=None``
    reads every element.  The references below take the same argument, so an
    adapter's sampled answer is still checked exactly.

Divergence guard
    When overflows keep coming while the scale sits at its floor for
    ``patience`` consecutive overflow steps, training stops with
    :class:`DivergenceError` naming what was seen and what to try.

Auto-fallback
    After ``threshold`` overflows blamed on the same module, that module is
    moved to the policy's FP32 rules (:class:`FallbackTracker`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from ..dtypes import FORMATS, canonical_dtype

if TYPE_CHECKING:
    from ..recipes import Recipe

METER_SAMPLES = 4096
"""Default elements per tensor that the underflow and swamping meters read (``None``: all)."""


def sample_stride(numel: int, samples: int | None = METER_SAMPLES) -> int:
    """Stride over a flattened tensor of ``numel`` elements that reads at most ``samples`` of them.

    Rule: 1 when ``samples`` is None or ``numel <= samples``; else
    ``ceil(numel / samples)``, made odd (+1 when even) so that the samples walk
    across the columns of power-of-two-wide matrices instead of always landing
    on the same few.

    >>> sample_stride(1000), sample_stride(1024 * 1024), sample_stride(10**6, None)
    (1, 257, 1)
    """
    if samples is None or numel <= samples:
        return 1
    if not isinstance(samples, int) or samples < 1:
        raise ValueError(f"meter samples={samples!r} must be a positive integer or None")
    stride = -(-numel // samples)
    return stride + 1 if stride % 2 == 0 else stride


def check_samples(samples: int | None) -> int | None:
    """Validate a ``samples`` argument: a positive int or None (clear error otherwise)."""
    if samples is not None and (isinstance(samples, bool) or not isinstance(samples, int) or samples < 1):
        raise ValueError(f"meter_samples={samples!r} must be a positive integer (elements per tensor) or None (all)")
    return samples


def sampled(values: Any, samples: int | None = None) -> np.ndarray:
    """The elements a meter reads from ``values``: flattened, every :func:`sample_stride`-th."""
    flat = np.asarray(values).ravel()
    return flat[::sample_stride(flat.size, samples)]


def fraction(lost: float, total: float) -> float:
    """``lost / total`` as a float, 0.0 when nothing was counted (``total == 0``): every meter's share."""
    lost, total = float(lost), float(total)
    return lost / total if total else 0.0


def underflow_threshold(compute: str, scale: float) -> float:
    """Unscaled gradient magnitude below which a value flushes to zero in ``compute``."""
    return FORMATS[canonical_dtype(compute)].smallest_subnormal / 2.0 / float(scale)


def grad_underflow_fraction(grads: list[Any], compute: str, scale: float, samples: int | None = None) -> float:
    """NumPy reference of the underflow rule over FP32 gradients (``samples``: see :func:`sample_stride`)."""
    limit = underflow_threshold(compute, scale)
    total = lost = 0
    for g in grads:
        a = np.abs(sampled(g, samples).astype(np.float64))
        nz = a[a > 0]
        total += nz.size
        lost += int(np.count_nonzero(nz < limit))
    return fraction(lost, total)


def half_ulp(weights: Any, storage: str) -> np.ndarray:
    """Half the spacing of representable ``storage`` numbers at each weight."""
    fmt = FORMATS[canonical_dtype(storage)]
    w = np.abs(np.asarray(weights, dtype=np.float64))
    floor = np.float64(fmt.tiny)
    exp = np.floor(np.log2(np.maximum(w, floor)))
    return np.exp2(exp - fmt.mantissa_bits - 1)


def update_swamped_fraction(weights: list[Any], updates: list[Any], storage: str,
                            samples: int | None = None) -> float:
    """NumPy reference of the swamping rule: share of non-zero updates lost in ``storage``
    (``samples``: the same elements of weight and update, see :func:`sample_stride`)."""
    total = lost = 0
    for w, d in zip(weights, updates):
        d = np.abs(sampled(d, samples).astype(np.float64))
        h = half_ulp(sampled(w, samples), storage)
        mask = d > 0
        total += int(mask.sum())
        lost += int(np.count_nonzero(d[mask] < h[mask]))
    return fraction(lost, total)


def swamp_storage_dtype(recipe: Recipe, stored_dtype: str, kept_fp32: bool) -> str:
    """The dtype a parameter's updates are measured against by ``mp/update_swamped_frac``.

    The meter answers "which updates would be lost if the weight were stored in
    low precision with no FP32 master":

    * ``*-master``: the parameter's actual storage dtype (``stored_dtype``:
      fp16/bf16, or float32 for parameters the policy keeps in FP32, which are
      their own masters);
    * ``*-mixed`` and ``32-true``: the dtype the matching ``*-master`` recipe
      would store it in: the policy's compute dtype, or float32 for modules
      the policy keeps in FP32 (``kept_fp32``).  Under ``32-true`` this is
      float32 everywhere.
    """
    if recipe.master.master_weights:
        return stored_dtype
    return "float32" if kept_fp32 else recipe.policy.compute
