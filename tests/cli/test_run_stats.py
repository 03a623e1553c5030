"""mp_callbacks/app/run_stats.py: the numbers every compare runner computes the same way from its step records,
checked against the standard library's statistics and the core's memory estimate."""

from __future__ import annotations

import math
import statistics

from mp_callbacks.app.run_stats import (
    TAIL_STEPS,
    estimate_per_param,
    finite_mean,
    loss_tail,
    run_diagnostics,
    standard_error,
)
from mp_callbacks.diagnostics import FP8_SATURATED_FRAC, FP8_UNDERFLOW_FRAC, StepStats
from mp_callbacks.memory import estimate_memory
from mp_callbacks.recipes import get_recipe


def _step(i: int, **kw) -> StepStats:
    return StepStats(step=i, scale=1.0, overflow=False, overflows_total=0, skipped_total=0, growths_total=0, **kw)


def test_means_and_errors_leave_out_what_is_not_finite():
    values = [0.5, None, float("nan"), 1.5, float("inf"), 2.0]
    finite = [0.5, 1.5, 2.0]
    assert finite_mean(values) == statistics.fmean(finite)
    assert finite_mean([None, float("nan")]) is None
    assert math.isclose(standard_error(finite), statistics.stdev(finite) / math.sqrt(len(finite)))
    assert math.isnan(standard_error([1.0])) and math.isnan(standard_error([]))


def test_the_loss_tail_is_the_last_finite_losses():
    history = [_step(i, loss=float(i)) for i in range(25)] + [_step(25, loss=float("inf")), _step(26)]
    assert loss_tail(history) == [float(i) for i in range(25 - TAIL_STEPS, 25)]
    assert loss_tail(history, 3) == [22.0, 23.0, 24.0]
    tail = loss_tail([_step(0, loss=float("nan"))])
    assert len(tail) == 1 and math.isnan(tail[0])


def test_diagnostics_average_what_was_measured_and_leave_out_the_rest():
    monitored = [_step(0, update_swamped_frac=0.25, grad_underflow_frac=0.0), _step(4, update_swamped_frac=0.75)]
    steps = [_step(0, fp8={FP8_SATURATED_FRAC: 0.1, FP8_UNDERFLOW_FRAC: 0.3}), _step(1), _step(2, fp8={})]
    storage = [(96, "bfloat16"), (32, "float32")]
    got = run_diagnostics(monitored, steps, storage)
    assert got == {"update_swamped_frac": statistics.fmean([0.25, 0.75]), "grad_underflow_frac": 0.0,
                   "fp8_saturated_frac": 0.1, "fp8_underflow_frac": 0.3, "low_precision_params": 96 / 128}
    assert run_diagnostics([], [_step(0)], [(8, "float32")]) == {"low_precision_params": 0.0}


def test_the_estimate_is_the_core_estimate_and_nan_for_an_unknown_optimizer():
    storage = [(100, "bfloat16"), (10, "float32")]
    want = estimate_memory(get_recipe("bf16-master").master, "adamw", storage, fp32_master_grads=True)
    assert estimate_per_param("bf16-master", "AdamW", 0, storage, fp32_master_grads=True) == want.bytes_per_param
    assert math.isnan(estimate_per_param("bf16-master", "MyOwnOptimizer", 0, storage))
