"""mp_callbacks.recommend: the decision rule of ``mpx compare``'s recommendation, on constructed runs."""

from __future__ import annotations

import math

import pytest

from mp_callbacks import recommend as rc
from mp_callbacks.recommend import RunOutcome, higher_is_better, recommend


def _run(recipe, speed=100.0, metric=1.0, se=0.01, bpp=16.0, peak=100.0, **kw):
    return RunOutcome(recipe, samples_per_s=speed, step_spread=0.02, peak_mb=peak, bytes_per_param=bpp,
                      metric=metric, metric_se=se, **kw)


def _runs(*others, control_metric=1.0, control_speed=100.0):
    return [_run("32-true"), *others, _run("32-true", speed=control_speed, metric=control_metric, control=True)]


def test_the_fastest_recipe_within_tolerance_is_chosen_with_its_evidence():
    rec = recommend(_runs(_run("bf16-master", speed=140.0, metric=1.005), _run("16-mixed", speed=120.0)))
    assert rec.recipe == "bf16-master" and rec.goal == "speed"
    assert rec.reason.startswith("bf16-master: 1.40x the samples/s of 32-true, 16.0 B/param")
    assert "within the noise of 32-true (tolerance 0.02)" in rec.reason
    assert any(line.startswith("16-mixed: 1.20x") for line in rec.others)
    assert rec.lines()[0].startswith("Recommended (speed): bf16-master")


def test_the_tolerance_is_derived_from_the_measured_noise():
    base, ctl = _run("32-true", se=0.01), _run("32-true", metric=1.05, control=True)
    tol, rule = rc.tolerance(base, ctl)
    assert tol == pytest.approx(0.05)  # the control's drift beats 2 s.e. (0.02)
    assert rule.startswith("0.05 = max(control run 0.05, 2 s.e. of 32-true's metric 0.02")
    tol, rule = rc.tolerance(base, _run("32-true", control=True))
    assert tol == pytest.approx(2 * 0.01) and "control run 0," in rule  # a deterministic machine: drift 0
    assert rc.tolerance(base, None)[0] == pytest.approx(0.02)


def test_a_metric_worse_beyond_the_tolerance_is_not_eligible_but_better_is():
    worse = _run("bf16-sr", speed=200.0, metric=1.03)  # 2 s.e. = 0.02: 0.03 worse
    better = _run("bf16-kahan", speed=150.0, metric=0.9)
    rec = recommend(_runs(worse, better))
    assert rec.recipe == "bf16-kahan"
    assert any(line.startswith("bf16-sr:") and "worse than 32-true beyond the tolerance" in line for line in rec.others)
    assert rec.eligible == ("32-true", "bf16-kahan")
    assert "better than 32-true beyond the tolerance" in rec.reason


def test_higher_is_better_metrics_are_compared_the_other_way():
    acc = [_run("32-true", metric=0.9), _run("bf16-master", speed=150.0, metric=0.8),
           _run("32-true", metric=0.9, control=True)]
    assert recommend(acc, higher=True, metric_name="accuracy").recipe == "32-true"
    assert recommend(acc, higher=False, metric_name="accuracy").recipe == "bf16-master"


def test_failed_and_diverged_runs_are_never_chosen():
    failed = RunOutcome("16-mixed", error="TypeError: mixed dtypes")
    diverged = RunOutcome("16-master", error="DivergenceError: 5 non-finite losses in a row")
    nan = _run("bf16-sr", speed=500.0, metric=math.nan)
    rec = recommend(_runs(failed, diverged, nan))
    assert rec.recipe == "32-true"
    assert "16-mixed: failed: TypeError: mixed dtypes" in rec.others
    assert any("bf16-sr" in line and "diverged" in line for line in rec.others)
    assert any("stopped by the divergence rule" in w and "16-master" in w for w in rec.warnings)
    assert not any(w.startswith("16-mixed") for w in rec.warnings)  # a failure is in the evidence already


def test_ties_within_the_timing_noise_go_to_the_least_model_state():
    quick = _run("bf16-mixed", speed=103.0, bpp=16.0)
    small = _run("bf16-sr", speed=101.0, bpp=12.0)  # within the noise of the fastest, 4 B/param less
    rec = recommend(_runs(quick, small, control_speed=97.0))  # noise: |100/97 - 1| = 3%
    assert rec.recipe == "bf16-sr"
    assert rc.timing_noise(_run("32-true"), _run("32-true", speed=97.0, control=True)) == pytest.approx(100 / 97 - 1)


def test_no_gain_beyond_the_noise_keeps_32_true():
    rec = recommend(_runs(_run("16-master", speed=101.0), control_speed=98.0))  # same state, 1% faster: noise
    assert rec.recipe == "32-true"


def test_a_busy_machine_does_not_make_a_slow_recipe_as_fast():
    slow_small = _run("bf16-sr", speed=30.0, bpp=12.0)
    rec = recommend(_runs(slow_small, control_speed=50.0))  # noise 100%: ties are capped at SPEED_TIE_MAX
    assert rec.recipe == "32-true"
    assert "no other recipe is faster beyond the timing noise" in rec.reason
    assert any(w.startswith("timing noise 100%") for w in rec.warnings)


def test_the_timing_noise_of_a_faster_control_counts_like_a_slower_one():
    base = _run("32-true")
    assert rc.timing_noise(base, _run("32-true", speed=200.0, control=True)) == pytest.approx(1.0)
    assert rc.timing_noise(base, _run("32-true", speed=50.0, control=True)) == pytest.approx(1.0)


def _seen_on_a_busy_machine(kahan_speed=973.0, control_speed=100 / 0.311):
    """The comparison seen on a machine loaded by other jobs: the control took 0.311 of 32-true's step time."""
    return _runs(_run("bf16-kahan", speed=kahan_speed, metric=1.005, bpp=14.0, peak=90.0),
                 _run("bf16-master", speed=120.0, peak=95.0), control_speed=control_speed)


def test_a_speed_up_within_the_timing_noise_is_inconclusive_and_memory_and_the_metric_decide():
    rec = recommend(_seen_on_a_busy_machine())
    # noise: 1 / 0.311 - 1 = 221.5%; bf16-kahan: 9.73x the baseline, 3.03x the control (the faster 32-true run)
    assert rec.timing_noise == pytest.approx(1 / 0.311 - 1)
    assert rec.inconclusive == ("inconclusive: timing noise 221.5% is larger than bf16-kahan's speed-up over 32-true "
                                "(3.03x the samples/s of 32-true's faster run, 9.73x the baseline's), so speed names "
                                "no recipe")
    # picked as goal memory picks: bf16-kahan has the smallest peak (90 MB), its metric within the tolerance
    assert rec.recipe == "bf16-kahan" and rec.basis == "memory and loss"
    assert rec.reason.startswith(rec.inconclusive + "; picked on memory and loss only (neither depends on the timing")
    assert ": bf16-kahan: 9.73x the samples/s of 32-true, 14.0 B/param, peak 90 MB" in rec.reason
    assert rec.lines()[0].startswith("Recommended (speed): inconclusive: timing noise 221.5%")
    assert any(line.startswith("32-true: the baseline") for line in rec.others)  # every other run's evidence stays
    assert any(w.startswith("timing noise 222% (the machine was busy?)") for w in rec.warnings)
    # a slower control: the noise (40%) is larger than the pick's 30%, though the tie band stops at 5%; every
    # peak and state the same: memory keeps 32-true (nothing to change), and says why
    rec = recommend(_runs(_run("bf16-kahan", speed=130.0), control_speed=100 / 1.4))
    assert rec.inconclusive.startswith("inconclusive: timing noise 40.0% is larger than bf16-kahan's speed-up over "
                                       "32-true (1.30x")
    assert rec.recipe == "32-true" and rec.reason.endswith("no other recipe is smaller beyond the memory noise with "
                                                           "the metric in tolerance")


def test_32_true_is_not_named_for_speed_when_a_rival_is_within_the_timing_noise():
    """The pick that flipped between two runs of one demo: 32-true at 64% timing noise over a recipe measured
    at 0.80x of it; the same recipe at 1.37x with 12% noise is named."""
    busy = recommend(_runs(_run("bf16-master", speed=80.0), control_speed=100 / 1.64))
    assert busy.inconclusive == ("inconclusive: timing noise 64.0% is larger than the difference between 32-true and "
                                 "bf16-master (bf16-master at 0.80x the samples/s of 32-true's faster run), so speed "
                                 "names no recipe")
    assert busy.recipe == "32-true" and "picked on memory and loss only" in busy.reason
    idle = recommend(_runs(_run("bf16-master", speed=137.0), control_speed=100 / 1.12))
    assert idle.recipe == "bf16-master" and idle.inconclusive is None and idle.basis == "speed"
    clear = recommend(_runs(_run("bf16-master", speed=40.0), control_speed=100 / 1.64))  # 2.5x slower: beyond 64%
    assert clear.recipe == "32-true" and clear.inconclusive is None


def test_a_speed_up_beyond_the_timing_noise_is_still_named():
    clean = recommend(_seen_on_a_busy_machine(control_speed=99.0))  # the same runs on an idle machine: noise 1%
    assert clean.recipe == "bf16-kahan" and clean.reason.startswith("bf16-kahan: 9.73x the samples/s of 32-true")
    noisy = recommend(_runs(_run("bf16-kahan", speed=200.0), control_speed=100 / 1.4))  # 2x beats 40% noise
    assert noisy.recipe == "bf16-kahan"
    faster_ctl = recommend(_seen_on_a_busy_machine(kahan_speed=1100.0))  # 3.42x the control: beyond 221.5%
    assert faster_ctl.recipe == "bf16-kahan"


def test_an_inconclusive_timing_leaves_the_memory_goal_and_the_tolerance_alone():
    runs = _seen_on_a_busy_machine()
    speed, memory = recommend(runs), recommend(runs, goal="memory")
    assert memory.recipe == "bf16-kahan" and memory.lines()[0].startswith("Recommended (memory): bf16-kahan")
    assert speed.tolerance == memory.tolerance == pytest.approx(0.02) and speed.tolerance_rule == memory.tolerance_rule


def test_both_frameworks_recommendations_go_through_the_rule():
    """The Lightning and Keras comparisons' runs (RunResult, as the runners return them) reach the same rule."""
    from mp_callbacks.app.compare import RunResult
    from mp_callbacks.app.report import recommendation_lines, recommendations

    def result(framework, recipe, step_ms, control=False):
        return RunResult(framework=framework, recipe=recipe, params=1000, samples_per_s=128_000 / step_ms,
                         step_time_ms=step_ms, peak_rss_mb=50.0, state_bytes_per_param=16.0,
                         estimate_bytes_per_param=16.0, final_loss=1.0, accuracy=0.9, overflows=0, skipped=0,
                         step_time_min_ms=step_ms * 0.99, step_time_max_ms=step_ms * 1.01, control=control,
                         metric_name="accuracy", metric=0.9, metric_se=0.01, higher_is_better=True)

    def runs(framework, control_ms):
        return [result(framework, "32-true", 10.0), result(framework, "bf16-kahan", 10.0 / 9.73),
                result(framework, "32-true", control_ms, control=True)]

    noisy = recommendations(runs("lightning", 3.11) + runs("keras", 3.11))
    assert {fw: rec.recipe for fw, rec in noisy.items()} == {"lightning": "32-true", "keras": "32-true"}  # memory ties
    assert all(rec.inconclusive for rec in noisy.values())
    text = recommendation_lines(noisy)
    assert sum(line.startswith("Recommended (speed): inconclusive: timing noise 221.5%") for line in text) == 2
    clean = recommendations(runs("lightning", 10.1) + runs("keras", 10.1))
    assert {fw: rec.recipe for fw, rec in clean.items()} == {"lightning": "bf16-kahan", "keras": "bf16-kahan"}


def test_goal_memory_picks_the_smallest_peak_then_the_least_state():
    runs = _runs(_run("bf16-master", speed=50.0, peak=60.0), _run("bf16-sr", speed=40.0, peak=60.5, bpp=12.0),
                 _run("16-mixed", speed=200.0, peak=90.0))
    rec = recommend(runs, goal="memory")
    assert rec.recipe == "bf16-sr"  # within 1 MB of the smallest peak, and 12 B/param
    assert rec.lines()[0].startswith("Recommended (memory): bf16-sr")
    with pytest.raises(ValueError, match="valid goals are speed, memory"):
        recommend(runs, goal="fast")


def test_without_a_finished_baseline_there_is_no_recommendation():
    rec = recommend([_run("bf16-master")])
    assert rec.recipe is None and "no 32-true run" in rec.reason
    rec = recommend([RunOutcome("32-true", error="MemoryError: "), _run("bf16-master")])
    assert rec.recipe is None and "32-true did not finish" in rec.reason


def test_the_diagnostics_raise_warnings_above_their_thresholds():
    runs = _runs(
        _run("bf16-kahan", diagnostics={"update_swamped_frac": 0.2}),
        _run("bf16-master", diagnostics={"update_swamped_frac": 0.3}),
        _run("16-mixed", diagnostics={"grad_underflow_frac": 0.01, "update_swamped_frac": 0.001}),
        _run("fp8-mixed", diagnostics={"fp8_saturated_frac": 1e-3}),
        _run("bf16-sr", diagnostics={"low_precision_params": 0.0}),
        _run("16-master", diagnostics={"low_precision_params": 0.3}),
        _run("bf16-mixed", diagnostics={"low_precision_params": 0.0}),  # FP32 params by design: no warning
    )
    warnings = recommend(runs).warnings
    assert ("bf16-kahan: 20.0% of the sampled updates are below half a bfloat16 ulp of their weight (swamped: the "
            "compensation buffer keeps them)" in warnings)
    assert not any(w.startswith("bf16-master") for w in warnings)  # the FP32 masters keep them
    assert "16-mixed: 1.00% of the non-zero gradients flush to zero in float16" in warnings
    assert any(w.startswith("fp8-mixed: 1.00e-03 of the FP8 elements saturate") for w in warnings)
    assert not any(w.startswith("16-mixed") and "swamped" in w for w in warnings)  # 0.1%: below the threshold
    assert ("bf16-sr: no parameters stored in bfloat16: the policy kept them all in FP32, so the run measures little "
            "of the recipe on this model" in warnings)
    assert any(w.startswith("16-master: only 30% of the parameters stored in float16: the policy kept the rest")
               for w in warnings)
    assert not any(w.startswith("bf16-mixed") for w in warnings)


def test_a_slowdown_carries_the_machine_note():
    rec = recommend(_runs(_run("16-mixed", speed=3.0, metric=1.0, overflows=3, skipped=2)),
                    notes={"16-mixed": "no native float16 matmul on this CPU"})
    line = next(line for line in rec.others if line.startswith("16-mixed"))
    assert "33.3x slower than 32-true on this machine (no native float16 matmul on this CPU)" in line
    assert "3 overflows, 2 skipped" in line


@pytest.mark.parametrize("name, expected", [("val_loss", False), ("loss", False), ("val_accuracy", True),
                                            ("f1", True), ("perplexity", False), ("throughput", None)])
def test_the_metric_direction_comes_from_its_name(name, expected):
    assert higher_is_better(name) is expected
