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

from typing import Any

import numpy as np

from ..dtypes import FORMATS, canonical_dtype

CHECKLIST = (
    "lower the learning rate (or warm it up), switch to bf16 (fp32's range), keep more ops in FP32 "
    "(norms, softmax, losses, custom ops: PrecisionPolicy.with_fp32_modules), check the data for "
    "extreme values, and look at mp/overflow_module for the first non-finite module"
)


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


class DivergenceError(RuntimeError):
    """Training keeps overflowing with the loss scale at its floor."""


class DivergenceGuard:
    """Stops a run whose scale sits at its floor for ``patience`` consecutive overflows."""

    def __init__(self, patience: int = 20) -> None:
        if not isinstance(patience, int) or patience < 1:
            raise ValueError(f"DivergenceGuard patience={patience!r} must be an integer >= 1")
        self.patience = patience
        self.streak = 0

    def observe(self, step: int, scale: float, min_scale: float, overflow: bool,
                module: str | None = None) -> None:
        """Feed one step; raises :class:`DivergenceError` when the streak reaches ``patience``."""
        if overflow and scale <= min_scale:
            self.streak += 1
        elif not overflow:
            self.streak = 0
        if self.streak >= self.patience:
            where = f", first non-finite module {module!r}" if module else ""
            raise DivergenceError(
                f"training diverged: {self.streak} consecutive overflows with the loss scale at its "
                f"floor (scale={scale:g}, min_scale={min_scale:g}) up to step {step}{where}. Try: {CHECKLIST}."
            )

    def state_dict(self) -> dict[str, int]:
        """Plain data: ``{"patience", "streak"}`` (the current run of overflows at the floor)."""
        return {"patience": self.patience, "streak": self.streak}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Restore a :meth:`state_dict` (patience and streak)."""
        self.patience, self.streak = int(state["patience"]), int(state["streak"])


class FallbackTracker:
    """Counts overflows blamed on each module; names a module once it reaches ``threshold``."""

    def __init__(self, threshold: int = 3) -> None:
        if not isinstance(threshold, int) or threshold < 1:
            raise ValueError(f"FallbackTracker threshold={threshold!r} must be an integer >= 1")
        self.threshold = threshold
        self.blame: dict[str, int] = {}
        self.moved: list[str] = []

    def blame_module(self, module: str) -> bool:
        """Record one overflow on ``module``; True exactly when it must move to FP32 now."""
        if module in self.moved:
            return False
        self.blame[module] = self.blame.get(module, 0) + 1
        if self.blame[module] >= self.threshold:
            self.moved.append(module)
            return True
        return False

    def state_dict(self) -> dict[str, Any]:
        """Plain data: ``{"threshold", "blame": {module: overflows}, "moved": [modules in FP32, in order]}``."""
        return {"threshold": self.threshold, "blame": dict(self.blame), "moved": list(self.moved)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict` (threshold, blame counts, moved modules)."""
        self.threshold = int(state["threshold"])
        self.blame = {str(k): int(v) for k, v in state["blame"].items()}
        self.moved = [str(m) for m in state["moved"]]
