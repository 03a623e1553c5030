"""``python -m mp_callbacks compare`` end to end: every recipe of the default suite in both frameworks,
at a small size, and its flag errors."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mp_callbacks.recipes import RECIPE_NAMES

from .baseline import check_against_baseline, check_baseline

pytestmark = pytest.mark.xdist_group("compare_cli")  # meant to run the report fixture once under loadgroup
ROOT = Path(__file__).resolve().parents[2]
# Small, but long enough to learn (lr 1e-2: the 32-true runs reach ~0.8 accuracy), so that the
# recipes can be compared with the 32-true row.  Steps cost ~2 ms; the run is dominated by imports.
STEPS, INJECT, HIDDEN, BATCH, LR = 40, 4, 32, 32, 0.01
FRAMEWORKS = ("lightning", "keras")
PAIRS = [(fw, rc) for fw in FRAMEWORKS for rc in RECIPE_NAMES]  # every adapter trains every recipe


def _run(*args, timeout=600):  # ~85 s on 2 idle cores; over 300 s at load 11
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", TF_CPP_MIN_LOG_LEVEL="2")
    env.setdefault("KERAS_BACKEND", "tensorflow")
    return subprocess.run([sys.executable, "-m", "mp_callbacks", *args], capture_output=True, text=True,
                          env=env, cwd=str(ROOT), timeout=timeout)


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    pytest.importorskip("lightning")
    pytest.importorskip("keras")
    out = tmp_path_factory.mktemp("report")
    # no --frameworks, no --recipes: the default suite (every recipe, both frameworks)
    proc = _run("compare", "--steps", str(STEPS), "--hidden", str(HIDDEN), "--batch-size", str(BATCH),
                "--lr", str(LR), "--inject", str(INJECT), "--threads", "1", "--quiet", "--out", str(out))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out, proc.stdout


@pytest.fixture(scope="module")
def results(report):
    out, _ = report
    data = json.loads((out / "results.json").read_text())
    return data, {(r["framework"], r["recipe"]): r for r in data["results"] if not r["control"]}


@pytest.fixture(scope="module")
def controls(report):
    out, _ = report
    data = json.loads((out / "results.json").read_text())
    return {r["framework"]: r for r in data["results"] if r["control"]}


# each framework's series ends with its control: 32-true run again
ROWS = [(fw, rc) for fw in FRAMEWORKS for rc in [r for f, r in PAIRS if f == fw] + ["32-true(ctl)"]]


def test_table_and_report_files(report):
    out, stdout = report
    rows = [line.split() for line in stdout.splitlines() if line.startswith(tuple(f"{fw} " for fw in FRAMEWORKS))]
    assert [r[:2] for r in rows] == [list(pair) for pair in ROWS]
    assert f"report written to {out}" in stdout
    for name in ("README.md", "results.json", "loss_curves.png"):
        assert (out / name).stat().st_size > 0, name
    for fw, recipe in PAIRS:
        lines = (out / f"{fw}_{recipe}.jsonl").read_text().splitlines()
        assert len(lines) >= STEPS
        assert (out / f"{fw}_{recipe}_scale.png").stat().st_size > 0
    readme = (out / "README.md").read_text()
    assert "not run" not in readme  # nothing skipped
    assert "# Mixed-precision comparison" in readme and "remapper" in readme  # the Keras-on-TF note


def test_every_recipe_is_measured_and_skips_the_injected_step(results):
    data, results = results
    assert data["spec"]["steps"] == STEPS and data["spec"]["inject"] == [INJECT] and data["spec"]["lr"] == LR
    assert set(results) == set(PAIRS)
    params = 64 * HIDDEN + HIDDEN + HIDDEN * HIDDEN + HIDDEN + HIDDEN * 10 + 10
    for (fw, recipe), r in results.items():
        # The injected inf is detected and skipped by every recipe (skip_nonfinite on by default).
        assert r["overflows"] == 1 and r["skipped"] == 1, (fw, recipe, r)
        assert r["samples_per_s"] > 0 and r["step_time_ms"] > 0
        assert r["params"] == params


@pytest.mark.parametrize("framework,recipe", [p for p in PAIRS if p[1] != "32-true"])
def test_each_recipe_trains_like_32_true(results, framework, recipe):
    _, results = results
    check_against_baseline(results[(framework, recipe)], results[(framework, "32-true")])


def test_both_frameworks_baselines_learn_alike(results):
    """Same data and steps; different initializers (Kaiming vs Glorot uniform): the margin of baseline.py."""
    _, results = results
    for fw in FRAMEWORKS:
        check_baseline(results[(fw, "32-true")])
    check_against_baseline(results[("keras", "32-true")], results[("lightning", "32-true")])


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_memory_per_param(results, framework):
    _, results = results
    # FP32 params: 4 weight + 4 grad + 8 Adam (m, v), every recipe without masters
    for recipe in ("32-true", "16-mixed", "bf16-mixed"):
        r = results[(framework, recipe)]
        assert r["state_bytes_per_param"] == r["estimate_bytes_per_param"] == 16.0, (framework, r)
    # *-master: fp16/bf16 hidden layers (Lightning: 4 FP32 grad + 4 master + 8 Adam = 16 B/param, the
    # low-precision weight released during the step; Keras: 2 weight + 4 FP32 grad, the whole list widened before
    # the inner optimizer, + 4 master + 8 Adam = 18) and an FP32 output layer (4 + 4 + 8)
    hidden = 64 * HIDDEN + HIDDEN + HIDDEN * HIDDEN + HIDDEN
    out = HIDDEN * 10 + 10
    per_hidden = 16 if framework == "lightning" else 18
    expected = (hidden * per_hidden + out * 16) / (hidden + out)
    for recipe in ("16-master", "bf16-master"):
        master = results[(framework, recipe)]
        assert master["state_bytes_per_param"] == pytest.approx(expected), (framework, master)
        assert master["estimate_bytes_per_param"] == pytest.approx(expected), (framework, master)


def test_step_times_come_with_their_spread(results):
    data, results = results
    assert data["timing"]["windows"] >= 3
    for key, r in results.items():
        windows = r["step_windows_ms"]
        assert len(windows) == data["timing"]["windows"], key  # 40 steps: enough for every window
        assert r["step_time_min_ms"] == min(windows) and r["step_time_max_ms"] == max(windows), key
        assert r["step_time_min_ms"] <= r["step_time_ms"] <= r["step_time_max_ms"], key
        assert r["samples_per_s"] == pytest.approx(1000 * BATCH / r["step_time_ms"]), key


def test_a_control_run_per_framework(report, results, controls):
    """32-true runs again, last: the report shows its ratio (the noise) and results.json keeps it."""
    data, results = results
    _, stdout = report
    assert set(controls) == set(FRAMEWORKS)
    for fw, ctl in controls.items():
        base = results[(fw, "32-true")]
        assert ctl["recipe"] == "32-true" and ctl["isolated"] and base["isolated"]
        assert data["control_step_time_ratio"][fw] == pytest.approx(ctl["step_time_ms"] / base["step_time_ms"])
        # same seed, data and steps: the same training, step for step
        assert ctl["final_loss"] == base["final_loss"] and ctl["accuracy"] == base["accuracy"]
    assert "control: 32-true(ctl) step time / 32-true's:" in stdout


def test_memory_does_not_depend_on_run_order(results, controls):
    """32-true runs first and last: each in a process of its own, so both hold the same model state and
    about the same peak (run in one process, the second run reused the first one's memory: ~0 MB)."""
    _, results = results
    for fw, ctl in controls.items():
        base = results[(fw, "32-true")]
        assert ctl["model_state_mb"] == base["model_state_mb"] > 0
        assert ctl["model_state_mb"] + ctl["other_mb"] == pytest.approx(ctl["peak_rss_mb"])
        assert abs(ctl["peak_rss_mb"] - base["peak_rss_mb"]) <= 0.25 * base["peak_rss_mb"] + 1.0, (fw, ctl, base)


def test_the_report_names_the_cpu_and_its_features(report):
    out, stdout = report
    data = json.loads((out / "results.json").read_text())
    machine = data["machine"]
    assert machine["cpu"] and machine["isolated_runs"] is True
    assert {"amx_bf16", "avx512_bf16", "avx512_fp16"} <= set(machine["features"])
    assert set(machine["matmul_slowdown_vs_float32"]) == {"float16", "bfloat16"}
    assert "CPU features: " in stdout and "  bfloat16: " in stdout and "  float16: " in stdout
    assert f"CPU: {machine['cpu']}" in (out / "README.md").read_text()


def test_history_records_the_skip(report):
    out, _ = report
    for fw, recipe in PAIRS:
        steps = [json.loads(line) for line in (out / f"{fw}_{recipe}.jsonl").read_text().splitlines()]
        steps = [s for s in steps if "scale" in s]
        flagged = [s["step"] for s in steps if s["overflow"]]
        assert flagged == [INJECT], (fw, recipe, flagged)
        assert steps[INJECT]["skipped_total"] == steps[INJECT - 1]["skipped_total"] + 1
        assert steps[INJECT]["loss"] == "inf" or steps[INJECT]["loss"] == float("inf")
        if recipe.startswith("16-"):
            # The scale each step ran with: the torch preset backs off after the overflow.
            assert steps[INJECT]["scale"] == steps[INJECT - 1]["scale"] == 2.0**16, (fw, recipe)
            assert steps[INJECT + 1]["scale"] == 2.0**15, (fw, recipe)
        else:  # no loss scaling: a static scale of 1 that still skips non-finite steps
            assert {s["scale"] for s in steps} == {1.0}, (fw, recipe)


def test_the_report_ends_with_a_recommendation_per_framework(report, results):
    """The built-in model's metric is its test accuracy (higher is better, binomial standard error)."""
    out, stdout = report
    data, results = results
    for fw in FRAMEWORKS:
        rec = data["recommendation"][fw]
        assert rec["metric_name"] == "accuracy" and rec["goal"] == "speed" and rec["tolerance"] > 0
        assert rec["recipe"] in RECIPE_NAMES
        if rec["inconclusive"]:  # a busy machine: the timing noise was above the differences; memory picked
            assert rec["inconclusive"].startswith(f"inconclusive: timing noise {rec['timing_noise']:.1%} ")
            assert rec["reason"].startswith(rec["inconclusive"] + "; picked on memory and accuracy only")
        else:
            assert rec["reason"].startswith(f"{rec['recipe']}: ")
        assert results[(fw, "32-true")]["higher_is_better"] is True
    readme = (out / "README.md").read_text()
    assert "## Recommendation" in readme and "lightning:" in readme and "keras:" in readme
    assert "Recommended (speed): " in stdout


@pytest.mark.parametrize("args, message", [
    (["compare", "--recipes", "fp12"], "mpx compare: error: unknown recipe 'fp12'; valid recipes: 32-true"),
    (["compare", "--steps", "10", "--inject", "10"], "mpx compare: error: inject steps [10] are outside [0, steps=10)"),
    (["compare", "--frameworks", "jax"], "argument --frameworks: invalid choice: 'jax'"),
    (["compare", "--steps", "0"], "argument --steps: 0 must be >= 1"),
    (["compare", "--threads", "-1"], "argument --threads: -1 must be >= 0"),
    (["compare", "--lr", "0"], "argument --lr: 0.0 must be a finite number > 0"),
    (["demo", "--steps", "5"], "unrecognized arguments: --steps 5"),
])
def test_bad_flags_are_clear(args, message):
    proc = _run(*args, timeout=120)
    assert proc.returncode != 0
    assert message in proc.stderr, proc.stderr[-2000:]


@pytest.mark.slow
def test_demo_runs_every_recipe_in_both_frameworks(tmp_path):
    """``make demo`` (about a minute on 2 cores; the fast tests above cover the same paths)."""
    pytest.importorskip("lightning")
    pytest.importorskip("keras")
    proc = _run("demo", "--quiet", "--out", str(tmp_path), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line.split() for line in proc.stdout.splitlines() if line.startswith(("lightning ", "keras "))]
    assert len(rows) == len(ROWS) and all(int(r[-1]) >= 1 for r in rows)  # the injected overflow skipped everywhere
    assert (tmp_path / "README.md").exists()
