"""The scaler's metric series: what the core's scaler produces for a found-inf pattern, and the same
series read back from logged rows, so that each adapter's monitor is compared like with like.

Conventions of a logged step ``k`` (1-based, one per scaler transition): ``mp/scale`` is the scale
step ``k``'s gradients were produced with (before the transition), the counters are the totals after.
"""

from __future__ import annotations

import csv
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from mp_callbacks.diagnostics import GROWTHS_TOTAL, OVERFLOW, OVERFLOWS_TOTAL, SCALE, SKIPPED_TOTAL
from mp_callbacks.loss_scale import DynamicLossScaler, ScalerConfig

SCALER_SERIES = (SCALE, OVERFLOW, OVERFLOWS_TOTAL, SKIPPED_TOTAL, GROWTHS_TOTAL)
"""The metric names whose per-step sequences are fixed by the scaler alone."""


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
