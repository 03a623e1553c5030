"""What every runner of ``mpx compare`` computes the same way from a finished run, in plain data.

The built-in runners (:mod:`~mp_callbacks.app.lightning_runner`, :mod:`~mp_callbacks.app.keras_runner`)
and the own-model paths (:mod:`~mp_callbacks.app.lightning_model`, :mod:`~mp_callbacks.app.keras_model`)
hand their step records here: the final loss, the diagnostics of a report row, the memory estimate.
No framework is imported.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from ..diagnostics import FP8_SATURATED_FRAC, FP8_UNDERFLOW_FRAC, StepStats
from ..memory import estimate_memory, optimizer_kind
from ..recipes import get_recipe

__all__ = ["TAIL_STEPS", "estimate_per_param", "finite_mean", "loss_tail", "run_diagnostics", "standard_error"]

TAIL_STEPS = 10
"""The final loss of a run: the mean of its last ``TAIL_STEPS`` finite step losses."""


def finite_mean(values: Iterable[Any]) -> float | None:
    """The mean of the finite values (None and non-finite ones left out); None when there are none."""
    finite = [float(v) for v in values if v is not None and math.isfinite(float(v))]
    return float(np.mean(finite)) if finite else None


def standard_error(values: Iterable[float]) -> float:
    """The standard error of the mean of the finite values (NaN for fewer than two)."""
    finite = [float(v) for v in values if math.isfinite(v)]
    return float(np.std(finite, ddof=1) / math.sqrt(len(finite))) if len(finite) > 1 else float("nan")


def loss_tail(history: Iterable[StepStats], n: int = TAIL_STEPS) -> list[float]:
    """The last ``n`` finite step losses of ``history`` (``[nan]`` when it has none)."""
    losses = [s.loss for s in history if s.loss is not None and math.isfinite(s.loss)]
    return losses[-n:] or [float("nan")]


def run_diagnostics(monitor_steps: Iterable[StepStats], steps: Iterable[StepStats],
                    storage: Sequence[tuple[int, str]]) -> dict[str, float]:
    """A report row's diagnostics: the swamped and underflow fractions the monitor sampled (``monitor_steps``),
    the FP8 fractions of the recorded ``steps``, and the share of parameters stored below FP32 (``storage``:
    ``(count, dtype name)`` per parameter tensor); a diagnostic nothing measured is left out."""
    monitored, recorded = list(monitor_steps), [s for s in steps if s.fp8]
    n_params = sum(n for n, _ in storage)
    found = {
        "update_swamped_frac": finite_mean(s.update_swamped_frac for s in monitored),
        "grad_underflow_frac": finite_mean(s.grad_underflow_frac for s in monitored),
        "fp8_saturated_frac": finite_mean(s.fp8.get(FP8_SATURATED_FRAC) for s in recorded),
        "fp8_underflow_frac": finite_mean(s.fp8.get(FP8_UNDERFLOW_FRAC) for s in recorded),
        "low_precision_params": sum(n for n, dtype in storage if dtype != "float32") / n_params if n_params else None,
    }
    return {k: v for k, v in found.items() if v is not None}


def estimate_per_param(recipe: str, optimizer_name: str, momentum: float, storage: Sequence[tuple[int, str]],
                       **kwargs: Any) -> float:
    """:func:`~mp_callbacks.memory.estimate.estimate_memory`'s bytes per parameter for ``recipe`` with the
    optimizer class ``optimizer_name`` (``kwargs``: its options); NaN for an optimizer the estimate does not know."""
    try:
        kind = optimizer_kind(optimizer_name, momentum)
        return estimate_memory(get_recipe(recipe).master, kind, storage, **kwargs).bytes_per_param
    except ValueError:
        return float("nan")
