"""The core's meter rules (:mod:`mp_callbacks.diagnostics.meters`) evaluated with torch on the device.

Every ``*_counts`` function returns 0-d device tensors and reads nothing back
to the host; the ``*_fraction`` conveniences call them and read the result
(one sync), for tests and interactive use.  The rules are exactly the NumPy
references':

* underflow: a non-zero FP32 gradient ``g`` is lost when
  ``|g| < smallest_subnormal(compute) / 2 / scale`` (threshold computed in
  float64 as the reference does, then rounded *up* to float32, which keeps
  ``|g| < threshold`` exact for float32 ``g``);
* swamping: a non-zero update ``d`` on weight ``w`` is lost when
  ``|d| < 2**(floor(log2(max(|w|, tiny))) - mantissa_bits - 1)``, compared on
  the binary exponents (``torch.frexp``), so no rounding is involved.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

import torch
from torch import Tensor

from mp_callbacks.diagnostics import fraction, sample_stride
from mp_callbacks.dtypes import FORMATS, canonical_dtype

__all__ = [
    "grad_norm", "sample", "grad_underflow_fraction", "swamped_counts", "underflow_counts", "underflow_limit",
    "update_swamped_fraction",
]


def _dense(t: Tensor) -> Tensor:
    if hasattr(t, "device_mesh") and hasattr(t, "to_local"):  # a DTensor (FSDP2): this rank's shard
        t = t.to_local()
    return t.coalesce()._values() if t.is_sparse else t


def sample(t: Tensor, samples: int | None = None) -> Tensor:
    """The elements a meter reads from ``t``: a strided view of the flattened tensor
    (:func:`mp_callbacks.diagnostics.sample_stride`; ``samples=None``: every element)."""
    flat = _dense(t).detach().reshape(-1)
    return flat[::sample_stride(flat.numel(), samples)]


def grad_norm(grads: Sequence[Tensor]) -> Tensor:
    """Global L2 norm of ``grads`` (0-d float32 tensor; inf when any gradient is non-finite)."""
    grads = [_dense(g) for g in grads]
    if not grads:
        return torch.zeros((), dtype=torch.float32)
    device = grads[0].device
    norms = [torch.linalg.vector_norm(g, dtype=torch.float32).to(device) for g in grads]
    return torch.linalg.vector_norm(torch.stack(norms))


def underflow_limit(compute: str, scale: Tensor | float, device: torch.device | str | None = None) -> Tensor:
    """The float32 threshold ``L`` with ``|g| < L`` exactly the reference's underflow rule (0-d tensor)."""
    half_sub = FORMATS[canonical_dtype(compute)].smallest_subnormal / 2.0
    if isinstance(scale, Tensor):
        limit64 = half_sub / scale.detach().to(torch.float64)
    else:
        limit64 = torch.tensor(half_sub / float(scale), dtype=torch.float64, device=device)
    limit32 = limit64.to(torch.float32)
    up = torch.nextafter(limit32, torch.full_like(limit32, float("inf")))
    return torch.where(limit32.to(torch.float64) < limit64, up, limit32)


def underflow_counts(grads: Iterable[Tensor], compute: str, scale: Tensor | float,
                     samples: int | None = None) -> tuple[Tensor, Tensor]:
    """``(lost, nonzero)`` element counts of the underflow rule over FP32 (unscaled) ``grads`` (no sync);
    ``samples``: elements read per tensor (:func:`sample`)."""
    def counts() -> Iterator[tuple[Tensor, Tensor]]:
        limit = None
        for g in grads:
            a = sample(g, samples).abs()
            if limit is None:
                limit = underflow_limit(compute, scale, a.device).to(a.device)
            nz = a > 0
            yield (nz & (a.to(torch.float32) < limit)).sum(), nz.sum()

    return _sum_counts(counts())


def _sum_counts(counts: Iterable[tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor]:
    """Sum per-tensor ``(lost, total)`` counts on the first one's device (int64 zeros when there are none)."""
    lost = total = None
    for n_lost, n_total in counts:
        total = n_total if total is None else total + n_total.to(total.device)
        lost = n_lost if lost is None else lost + n_lost.to(lost.device)
    if total is None:
        zero = torch.zeros((), dtype=torch.int64)
        return zero, zero.clone()
    return lost, total


def grad_underflow_fraction(grads: Sequence[Tensor], compute: str, scale: Tensor | float,
                            samples: int | None = None) -> float:
    """:func:`underflow_counts` as a fraction (reads the counts: one sync)."""
    lost, total = underflow_counts(grads, compute, scale, samples)
    lost_n, total_n = (int(v) for v in torch.stack([lost, total.to(lost.device)]).tolist())
    return fraction(lost_n, total_n)


def swamped_counts(weights: Iterable[Tensor], updates: Iterable[Tensor],
                   storages: str | Iterable[str], samples: int | None = None) -> tuple[Tensor, Tensor]:
    """``(lost, nonzero)`` counts of the swamping rule (no sync).

    Args:
      weights: the weights the updates were added to (any float dtype; the
        value before the step).
      updates: the applied updates (``after - before``), same shapes.
      storages: one storage dtype name for all, or one per weight.
      samples: elements read per tensor (:func:`sample`, the same ones of a
        weight and its update); the monitor passes tensors it already sampled.
    """
    weights = [sample(w, samples) for w in weights]
    updates = [sample(d, samples) for d in updates]
    if isinstance(storages, str):
        storages = [storages] * len(weights)
    def counts() -> Iterator[tuple[Tensor, Tensor]]:
        for w, d, storage in zip(weights, updates, storages):
            fmt = FORMATS[canonical_dtype(storage)]
            wa = w.detach().to(torch.float32).abs().clamp_min(fmt.tiny)
            _, w_exp = torch.frexp(wa)  # |w| = m * 2**e with m in [0.5, 1): floor(log2|w|) = e - 1
            da = d.detach().to(torch.float32).abs()
            _, d_exp = torch.frexp(da)
            nz = da > 0
            # |d| < 2**(e_w - 1 - mant - 1)  <=>  floor(log2|d|) < e_w - mant - 2  <=>  e_d <= e_w - mant - 2
            yield (nz & (d_exp <= w_exp - (fmt.mantissa_bits + 2))).sum(), nz.sum()

    return _sum_counts(counts())


def update_swamped_fraction(weights: Sequence[Tensor], updates: Sequence[Tensor],
                            storages: str | Sequence[str], samples: int | None = None) -> float:
    """:func:`swamped_counts` as a fraction (reads the counts: one sync)."""
    lost, total = swamped_counts(weights, updates, storages, samples)
    lost_n, total_n = (int(v) for v in torch.stack([lost, total.to(lost.device)]).tolist())
    return fraction(lost_n, total_n)
