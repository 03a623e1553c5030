"""How ``mpx compare`` measures: timed windows with their spread, one process per run, bytes/param once
the optimizer state exists, the CPU's features.  Structure and behaviour only: no wall-clock thresholds."""

from __future__ import annotations

import os

import pytest

from mp_callbacks.app import compare as mc
from mp_callbacks.app.machine import FEATURES, features, native_kernel, recipe_notes
from mp_callbacks.app.report import format_table


def test_step_timing_leaves_out_the_warm_up_and_reports_windows():
    # 20 steps: the first 10% (2 steps) is warm-up; 18 left in 5 windows of 3-4 steps
    times = [9.0, 9.0] + [0.001] * 6 + [0.002] * 6 + [0.004] * 6
    t = mc.step_timing(times)
    assert len(t.windows_ms) == mc.WINDOWS
    assert t.min_ms == pytest.approx(1.0) and t.max_ms == pytest.approx(4.0)
    assert t.min_ms <= t.median_ms <= t.max_ms and t.median_ms == sorted(t.windows_ms)[2]
    assert t.spread == pytest.approx((t.max_ms - t.min_ms) / t.median_ms)


def test_step_timing_with_few_steps():
    assert mc.step_timing([0.5]).windows_ms == (500.0,)  # one step: nothing to leave out
    t = mc.step_timing([5.0, 0.001, 0.003])  # one warm-up step, two windows of one step
    assert t.windows_ms == pytest.approx((1.0, 3.0)) and t.median_ms == pytest.approx(2.0)
    with pytest.raises(ValueError):
        mc.step_timing([])


def test_timing_fields_fill_the_result():
    fields = mc.timing_fields([1.0] + [0.002] * 10, batch_size=64)
    assert fields["step_time_ms"] == pytest.approx(2.0) and fields["samples_per_s"] == pytest.approx(32000)
    assert fields["step_time_min_ms"] == fields["step_time_max_ms"] == pytest.approx(2.0)
    row = mc.RunResult(framework="x", recipe="32-true", params=1000, peak_rss_mb=1.0, state_bytes_per_param=16.0,
                       estimate_bytes_per_param=16.0, final_loss=0.0, accuracy=1.0, overflows=0, skipped=0,
                       **fields).row()
    assert row["step_windows_ms"] == pytest.approx([2.0] * 5)
    assert row["model_state_mb"] == pytest.approx(16000 / 2**20)
    assert row["other_mb"] == pytest.approx(1.0 - 16000 / 2**20)


def _child(value, progress):
    for i in range(3):
        progress(i + 1)
    big = bytearray(8 * 2**20)  # allocated in the child only
    return {"value": value, "pid": os.getpid(), "big": len(big)}


def _fails(progress):
    raise ValueError("inside the child")


@pytest.mark.skipif(not mc.can_isolate(), reason="needs fork")
def test_run_isolated_runs_in_a_child_and_forwards_progress():
    seen = []
    got = mc.run_isolated(_child, 7, progress=seen.append)
    assert got["value"] == 7 and got["pid"] != os.getpid() and got["big"] == 8 * 2**20
    assert seen == [1, 2, 3]
    with pytest.raises(RuntimeError, match="ValueError: inside the child"):
        mc.run_isolated(_fails)


def test_cpu_features_and_what_they_mean():
    found = features({"avx2", "avx512f", "avx512_bf16"})
    assert set(found) == set(FEATURES) and found["avx512_bf16"] and not found["amx_bf16"]
    assert native_kernel("bfloat16", found) == "AVX512-BF16" and native_kernel("float16", found) == "none"
    assert native_kernel("bfloat16", features({"amx_bf16", "avx512_bf16"})) == "AMX-BF16"
    lines = recipe_notes(found, {"float16": 40.0, "bfloat16": 1.1})
    assert any(line.strip().startswith("bfloat16: AVX512-BF16 (no AMX)") and "1.1x" in line for line in lines)
    assert any(line.strip().startswith("float16: no native float16 matmul") and "40.0x" in line for line in lines)
    assert "not readable" in recipe_notes(features(set()))[0]


@pytest.mark.parametrize("recipe, expected", [("32-true", 16.0), ("bf16-master", 16.0)])
def test_lightning_bytes_per_param_after_one_step(recipe, expected):
    """With one step the optimizer state exists only once the step ran: measured at the step's end too
    (it read 8 before: grads + weights or masters, no m and v yet)."""
    pytest.importorskip("lightning")
    from mp_callbacks.app import lightning_runner as lc

    spec = mc.RunSpec(steps=1, batch_size=8, hidden=8, depth=1)
    result = lc.run(recipe, spec)
    assert result.skipped == 0
    # the FP32 output layer holds 16 too, so every recipe here is at 16 B/param, like the estimate
    assert result.state_bytes_per_param == expected == result.estimate_bytes_per_param


def test_lightning_bytes_per_param_when_no_step_was_applied():
    pytest.importorskip("lightning")
    from mp_callbacks.app import lightning_runner as lc

    result = lc.run("bf16-master", mc.RunSpec(steps=1, batch_size=8, hidden=8, depth=1, inject=(0,)))
    assert result.skipped == 1 and result.state_bytes_per_param is None and result.row()["model_state_mb"] is None
    assert "-" in format_table([result]).splitlines()[-1].split()  # printed as not measured
