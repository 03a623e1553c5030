"""Framework-neutral pieces both ``MixedPrecisionMonitor`` callbacks share.

* :func:`swamp_storage_dtype`: which dtype the swamping meter measures a
  parameter's update against ("lost without master weights").
* :func:`expected_series`: the ``mp/scale`` / ``mp/overflows_total`` /
  ``mp/skipped_total`` / ``mp/growths_total`` sequences the core's
  :class:`~mp_callbacks.loss_scale.scaler.DynamicLossScaler` produces for a found-inf
  pattern: what a monitor logging every step must log.
* :func:`series_from_rows` / :func:`read_csv_series`: the same sequences
  extracted from logged rows (plain lists), so adapters compare like with like.
* :data:`LOSS_SOURCE`: the attribution name used when the loss itself is
  non-finite while every module's forward output was finite.
* :func:`first_culprit` / :func:`attribution_order`: the one blame order of
  overflow attribution (forward outputs, then the loss, then gradients).

Conventions of a logged step ``k`` (1-based, one per scaler transition):
``mp/scale`` is the scale step ``k``'s gradients were produced with (the scale
*before* the transition), the counters are the totals *after* step ``k``.
"""

from __future__ import annotations

import csv
import os
from typing import Any, Iterable, Mapping, Sequence

from .metrics import GROWTHS_TOTAL, OVERFLOW, OVERFLOWS_TOTAL, SCALE, SKIPPED_TOTAL
from ..recipes import Recipe
from ..loss_scale.scaler import DynamicLossScaler
from ..loss_scale.config import ScalerConfig

LOSS_SOURCE = "<loss>"
"""Overflow attribution when the loss is non-finite but no module output was (never moved to FP32)."""

SCALER_SERIES = (SCALE, OVERFLOW, OVERFLOWS_TOTAL, SKIPPED_TOTAL, GROWTHS_TOTAL)
"""The metric names whose per-step sequences are fixed by the scaler alone."""


def attribution_order(forward: Sequence[str], backward: Sequence[str]) -> list[str]:
    """Every attribution candidate in blame order: ``forward`` (module outputs in call order),
    :data:`LOSS_SOURCE`, then ``backward`` (gradients in backward, i.e. reverse-call, order).

    The first non-finite entry of this list is :func:`first_culprit`'s answer;
    an adapter that picks the culprit on the device (Keras) builds its name
    table with this function and takes the first flagged index.
    """
    return [*forward, LOSS_SOURCE, *backward]


def first_culprit(forward_bad: Sequence[str], loss_bad: bool, backward_bad: Sequence[str]) -> str | None:
    """The module blamed for an overflow step, None when nothing non-finite was seen.

    The order (both frameworks):

    1. the first module whose forward output was non-finite, in call order
       (``forward_bad``: the non-finite forward records, in call order);
    2. else the loss itself (``loss_bad``): :data:`LOSS_SOURCE`;
    3. else the first module whose gradient (its input gradient or its own
       parameters' gradients) was non-finite, in backward (reverse-call)
       order (``backward_bad``: the non-finite gradient records, in that order).
    """
    if forward_bad:
        return forward_bad[0]
    if loss_bad:
        return LOSS_SOURCE
    return backward_bad[0] if backward_bad else None


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


def expected_series(config: ScalerConfig | str | Mapping[str, Any] | None, found_inf: Sequence[bool],
                    names: Sequence[str] = SCALER_SERIES) -> dict[str, list[float]]:
    """Per-step values of ``names`` that :class:`DynamicLossScaler` gives for ``found_inf`` (plain lists)."""
    scaler = DynamicLossScaler(config)
    out: dict[str, list[float]] = {n: [] for n in names}
    for flag in found_inf:
        used = scaler.scale
        scaler.update(bool(flag))
        row = {SCALE: used, OVERFLOW: float(bool(flag)), OVERFLOWS_TOTAL: float(scaler.overflows),
               SKIPPED_TOTAL: float(scaler.skipped), GROWTHS_TOTAL: float(scaler.growths)}
        for n in names:
            out[n].append(float(row[n]))
    return out


def series_from_rows(rows: Iterable[Mapping[str, Any]], names: Sequence[str] = SCALER_SERIES,
                     step_key: str = "step") -> dict[str, list[float]]:
    """``{name: [value per row that has it, in step order]}`` from logged metric rows.

    Empty strings (CSV cells of other metrics) count as absent; rows are sorted
    by ``step_key`` (stable, so rows without it keep their order at the end).
    """
    ordered = sorted(rows, key=lambda r: float(r.get(step_key, float("inf")) or float("inf")))
    out: dict[str, list[float]] = {n: [] for n in names}
    for row in ordered:
        for n in names:
            value = row.get(n)
            if value is None or value == "":
                continue
            out[n].append(float(value))
    return out


def read_csv_series(path: str | os.PathLike[str], names: Sequence[str] = SCALER_SERIES,
                    step_key: str = "step") -> dict[str, list[float]]:
    """:func:`series_from_rows` over a metrics CSV file with a header row (e.g. Lightning's ``metrics.csv``)."""
    with open(path, newline="", encoding="utf-8") as fh:
        return series_from_rows(list(csv.DictReader(fh)), names, step_key)
