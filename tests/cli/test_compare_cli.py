"""``python -m mp_callbacks compare`` end to end with both frameworks, and its flag errors."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STEPS, INJECT = 12, 4


def _run(*args, timeout=300):
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", TF_CPP_MIN_LOG_LEVEL="2")
    env.setdefault("KERAS_BACKEND", "tensorflow")
    return subprocess.run([sys.executable, "-m", "mp_callbacks", *args], capture_output=True, text=True,
                          env=env, cwd=str(ROOT), timeout=timeout)


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    pytest.importorskip("lightning")
    pytest.importorskip("keras")
    out = tmp_path_factory.mktemp("report")
    proc = _run("compare", "--frameworks", "lightning", "keras", "--recipes", "16-mixed", "bf16-master",
                "--steps", str(STEPS), "--hidden", "32", "--batch-size", "32", "--inject", str(INJECT),
                "--threads", "1", "--quiet", "--out", str(out))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out, proc.stdout


def test_table_and_report_files(report):
    out, stdout = report
    rows = [line.split() for line in stdout.splitlines() if line.startswith(("lightning ", "keras "))]
    assert [r[:2] for r in rows] == [[fw, rc] for fw in ("lightning", "keras")
                                     for rc in ("32-true", "16-mixed", "bf16-master")]
    assert f"report written to {out}" in stdout
    for name in ("README.md", "results.json", "loss_curves.png"):
        assert (out / name).stat().st_size > 0, name
    for fw in ("lightning", "keras"):
        for recipe in ("32-true", "16-mixed", "bf16-master"):
            lines = (out / f"{fw}_{recipe}.jsonl").read_text().splitlines()
            assert len(lines) >= STEPS
            assert (out / f"{fw}_{recipe}_scale.png").stat().st_size > 0
    readme = (out / "README.md").read_text()
    assert "# Mixed-precision comparison" in readme and "remapper" in readme  # the Keras-on-TF note


def test_results_are_sane(report):
    out, _ = report
    data = json.loads((out / "results.json").read_text())
    assert data["spec"]["steps"] == STEPS and data["spec"]["inject"] == [INJECT]
    results = {(r["framework"], r["recipe"]): r for r in data["results"]}
    assert len(results) == 6
    for (fw, recipe), r in results.items():
        # The injected inf is detected and skipped by every recipe (skip_nonfinite on by default).
        assert r["overflows"] == 1 and r["skipped"] == 1, (fw, recipe, r)
        assert r["samples_per_s"] > 0 and r["step_time_ms"] > 0
        assert r["final_loss"] == r["final_loss"] and 0 < r["final_loss"] < 5  # finite, trained a little
        assert 0.0 <= r["accuracy"] <= 1.0
        assert r["params"] == 64 * 32 + 32 + 32 * 32 + 32 + 32 * 10 + 10
    for fw in ("lightning", "keras"):
        assert results[(fw, "16-mixed")]["skipped"] >= 1
        master = results[(fw, "bf16-master")]
        # bf16 hidden layers (4 FP32 grad + 4 master + 8 Adam, + 2 for the bf16 weight that Keras keeps
        # during the step; the Lightning plugin releases it) and an FP32 output layer (4 + 4 + 8)
        hidden = 64 * 32 + 32 + 32 * 32 + 32
        out = 32 * 10 + 10
        per_hidden = 16 if fw == "lightning" else 18
        expected = (hidden * per_hidden + out * 16) / (hidden + out)
        assert master["state_bytes_per_param"] == pytest.approx(expected), (fw, master)
        assert master["estimate_bytes_per_param"] == pytest.approx(expected), (fw, master)
    # Both frameworks saw the same data: their baselines end at a similar accuracy.
    assert abs(results[("lightning", "32-true")]["accuracy"] - results[("keras", "32-true")]["accuracy"]) < 0.2


def test_history_records_the_skip(report):
    out, _ = report
    for fw in ("lightning", "keras"):
        steps = [json.loads(line) for line in (out / f"{fw}_16-mixed.jsonl").read_text().splitlines()]
        steps = [s for s in steps if "scale" in s]
        flagged = [s["step"] for s in steps if s["overflow"]]
        assert flagged == [INJECT], (fw, flagged)
        # The scale each step ran with: the torch preset backs off after the overflow.
        assert steps[INJECT]["scale"] == steps[INJECT - 1]["scale"] == 2.0**16
        assert steps[INJECT + 1]["scale"] == 2.0**15
        assert steps[INJECT]["skipped_total"] == steps[INJECT - 1]["skipped_total"] + 1
        assert steps[INJECT]["loss"] == "inf" or steps[INJECT]["loss"] == float("inf")


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
    assert len(rows) == 10 and all(int(r[-1]) >= 1 for r in rows)  # the injected overflow skipped everywhere
    assert (tmp_path / "README.md").exists()
