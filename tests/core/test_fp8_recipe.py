"""The ``fp8-mixed`` recipe in the core: its plan, its FP8 settings (knobs), names, memory and the
NumPy model of one FP8 matmul."""

from __future__ import annotations

import numpy as np
import pytest

from mp_callbacks.fp8 import (
    E4M3,
    E5M2,
    FP8ConfigError,
    FP8Recipe,
    FP8ScalingConfig,
    fp8_amax,
    fp8_linear_reference,
    fp8_qdq,
    fp8_round,
    fp8_state_bytes,
    fp8_transient_bytes,
)
from mp_callbacks.memory import bytes_per_param
from mp_callbacks.recipes import RECIPE_NAMES, Recipe, RecipeError, canonical_recipe_name, get_recipe, plan_resume

f32 = np.float32


def test_fp8_mixed_is_bf16_master_with_fp8_matmuls():
    r = get_recipe("fp8-mixed")
    assert "fp8-mixed" in RECIPE_NAMES
    base = get_recipe("bf16-master")
    assert (r.policy, r.master, r.scaler) == (base.policy, base.master, base.scaler)
    assert r.fp8 == FP8Recipe() and base.fp8 is None
    assert {k: c.format for k, c in r.fp8.configs.items()} == {
        "inputs": E4M3.name, "weights": E4M3.name, "grad_outputs": E5M2.name}
    assert r.fp8.configs["inputs"] == FP8ScalingConfig.preset("transformer-engine")  # delayed, 1024, max
    assert Recipe.from_dict(r.to_dict()) == r and "fp8" not in base.to_dict()
    assert bytes_per_param(r.master, "adamw") == 16.0  # bf16-master's model state


@pytest.mark.parametrize("name", ["fp8", "8", "fp8-master", "fp8-true", "float8", "e4m3"])
def test_fp8_spellings_suggest_fp8_mixed(name):
    with pytest.raises(RecipeError, match="did you mean 'fp8-mixed'"):
        canonical_recipe_name(name)


def test_knobs():
    r = get_recipe("fp8-mixed", fp8={"preset": "keras", "history_len": 16, "margin": 1})
    cfg = r.fp8.config("grad_outputs")
    assert (cfg.format, cfg.history_len, cfg.margin, cfg.update_order, cfg.stored) == (
        E5M2.name, 16, 1, "scale_first", "scale_inv")
    current = get_recipe("fp8-mixed", fp8={"mode": "current"}).fp8
    assert current.mode == "current" and current.config("inputs").history_len == 1
    assert get_recipe("fp8-mixed", fp8="torchao").fp8.mode == "current"
    assert FP8Recipe.coerce({"preset": "keras", "margin": 2}) == FP8Recipe("keras", (("margin", 2),))
    assert FP8Recipe.from_dict(r.fp8.to_dict()) == r.fp8
    with pytest.raises(FP8ConfigError, match="unknown FP8 setting"):
        FP8Recipe.coerce({"histroy_len": 3})
    with pytest.raises(FP8ConfigError, match="history_len=0 is invalid"):
        FP8Recipe.coerce({"history_len": 0})
    with pytest.raises(FP8ConfigError, match="valid presets"):
        FP8Recipe.coerce("te")
    with pytest.raises(RecipeError, match="fp8 settings need recipe 'fp8-mixed'"):
        get_recipe("bf16-master", fp8="keras")


def test_resume_across_recipes_keeps_the_masters():
    plan = plan_resume("bf16-master", get_recipe("fp8-mixed"), allow_recipe_change=True)
    assert plan.load_masters and not plan.load_scaler
    assert plan_resume("fp8-mixed", get_recipe("fp8-mixed")).load_masters


def test_memory_of_the_fp8_state_and_transients():
    assert fp8_state_bytes(FP8Recipe(), 1) == 3 * (4 * 1024 + 16)
    assert FP8Recipe.coerce({"history_len": 16}).state_bytes(10) == 10 * 3 * (64 + 16)
    assert fp8_state_bytes(FP8Recipe.coerce({"mode": "current"}), 2) == 2 * 3 * 20
    assert fp8_transient_bytes(100, 30) == {"kept": 130, "working": 520, "scales": 8}
    assert fp8_transient_bytes(100, 30, emulated=False)["working"] == 0


def test_qdq_reference_follows_the_stored_scale():
    x = np.asarray([0.0, 1e-4, 0.3, -2.5, 900.0, np.inf], f32)
    te, keras = FP8Recipe().config("inputs"), FP8Recipe("keras").config("inputs")
    scale = f32(448.0 / 2.5)
    inv = f32(1) / scale
    got = fp8_qdq(x, te, scale, inv)
    assert np.array_equal(got, fp8_round(x * scale, E4M3) * inv)
    assert np.isfinite(got).all() and got[-1] == got[-2] == f32(448.0) * inv  # saturated, inf included
    assert np.array_equal(fp8_qdq(x, keras, scale, inv), fp8_round(x / inv, E4M3) * inv)
    assert fp8_amax(np.asarray([1.0, -3.0], f32)) == 3.0 and np.isnan(fp8_amax(np.asarray([np.nan, 1.0])))


def test_linear_reference_gradients_are_those_of_the_quantized_operands():
    rng = np.random.default_rng(0)
    x, w, b, dy = (rng.normal(size=s).astype(f32) for s in ((2, 3, 4), (5, 4), (5,), (2, 3, 5)))
    r = FP8Recipe()
    scales = {role: (f32(2.0), f32(0.5)) for role in ("inputs", "weights", "grad_outputs")}
    out = fp8_linear_reference(x, w, b, dy, r, scales)
    xq, wq = fp8_round(x * 2, E4M3) / 2, fp8_round(w * 2, E4M3) / 2
    gq = fp8_round(dy * 2, E5M2) / 2
    np.testing.assert_allclose(out["y"], xq @ wq.T + b, rtol=1e-6)
    np.testing.assert_allclose(out["dx"], gq @ wq, rtol=1e-6)
    np.testing.assert_allclose(out["dw"], np.einsum("bto,bti->oi", gq, xq), rtol=1e-5)
    np.testing.assert_array_equal(out["db"], dy.sum(axis=(0, 1)))
    assert out["amax"]["grad_outputs"] == np.abs(dy).max()


def test_the_estimator_counts_the_fp8_state_once():
    from mp_callbacks.memory import MemoryEstimate, estimate_memory, memory_report

    r = get_recipe("fp8-mixed")
    fp8 = fp8_state_bytes(r.fp8, 3)
    est = estimate_memory(r.master, "adamw", 1000, fp32_master_grads=True, weights_released=True, fp8_state=fp8)
    assert (est.weights, est.grads, est.masters, est.optimizer_state, est.fp8_state) == (0, 4000, 4000, 8000, fp8)
    assert est.total == 16_000 + fp8 and est.to_dict()["fp8_state"] == fp8
    assert "fp8_state" not in estimate_memory(r.master, "adamw", 10).to_dict()  # records of other recipes unchanged
    actual = MemoryEstimate(params=1000, weights=0, grads=4000, masters=4000, optimizer_state=8000, fp8_state=fp8)
    report = memory_report("fp8-mixed", r.master, [("AdamW", 0.0, [(600, "bfloat16")]), ("AdamW", 0.0,
                           [(400, "bfloat16")])], actual, weights_released=True, fp8_state=fp8)
    assert report["estimate"] == actual.to_dict()  # added once, not per optimizer


def test_report_rows_and_plot(tmp_path):
    from types import SimpleNamespace

    from mp_callbacks.app.fp8_report import fp8_rows, fp8_table, report_lines
    from mp_callbacks.diagnostics import History, StepStats, fp8_metrics

    roles = ("inputs", "weights", "grad_outputs")
    steps = []
    for t, k in enumerate((1.0, 2.0, 4.0)):
        m = fp8_metrics(["net.0"], roles, {r: [k] for r in roles}, {r: [448.0 / k] for r in roles},
                        {r: [(t, 2 * t, 10)] for r in roles})
        steps.append(StepStats.from_counts(t, 1.0, False, 0, 0, 0, fp8=m))
    steps.insert(1, StepStats.from_counts(9, 1.0, False, 0, 0, 0))  # a step without FP8 metrics
    history = History.from_steps(steps)
    rows = fp8_rows(history)
    assert [r["tensor"] for r in rows] == ["net.0/inputs", "net.0/weights", "net.0/grad_outputs"]
    assert rows[0]["amax"] == 4.0 and rows[0]["scale"] == 112.0 and rows[0]["scale_max"] == 448.0
    assert rows[0]["saturated_frac"] == pytest.approx(0.1) and rows[0]["underflow_frac"] == pytest.approx(0.2)
    run = SimpleNamespace(framework="lightning", recipe="fp8-mixed", history=history)
    assert "net.0/grad_outputs" in fp8_table([run])
    md = report_lines([run, SimpleNamespace(framework="keras", recipe="bf16-mixed", history=History())], tmp_path)
    assert "![fp8 scales](lightning_fp8-mixed_fp8_scales.png)" in md
    assert (tmp_path / "lightning_fp8-mixed_fp8_scales.png").stat().st_size > 0
