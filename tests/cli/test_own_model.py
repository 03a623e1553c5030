"""``mpx compare --lightning/--keras`` and the Python functions on models nobody here wrote.

A Hugging Face GPT-2 built from its config (examples/compare_hf_gpt2.py) through the Lightning path
with every recipe, a keras_hub GPT-2 backbone (examples/compare_keras_hub.py) through the Keras path,
the Python API of both, and failed runs (an exception, a dead process) reported as failed rows that
the recommendation never picks.  Few steps, tiny models: each compare takes well under a minute.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mp_callbacks.recipes import RECIPE_NAMES

ROOT = Path(__file__).resolve().parents[2]
HF = ("--lightning", "examples.compare_hf_gpt2:make_module", "--datamodule", "examples.compare_hf_gpt2:make_datamodule")
KERAS_HUB = ("--keras", "examples.compare_keras_hub:build_model", "--data", "examples.compare_keras_hub:make_dataset")


def _env() -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", TF_CPP_MIN_LOG_LEVEL="2")
    env.setdefault("KERAS_BACKEND", "tensorflow")
    return env


def _mpx(*args: str, timeout: int = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mp_callbacks", "compare", *args], capture_output=True, text=True,
                          env=_env(), cwd=str(ROOT), timeout=timeout)


def _check_report(out: Path, recipes: list[str], framework: str) -> dict:
    """The report is complete: a row per recipe and the control, files, and a recommendation of a recipe that ran."""
    data = json.loads((out / "results.json").read_text())
    rows = [(r["recipe"], r["control"]) for r in data["results"]]
    assert rows == [(r, False) for r in recipes] + [("32-true", True)]
    rec = data["recommendation"][framework]
    ran = {r["recipe"] for r in data["results"] if r["error"] is None}
    named = "inconclusive" if rec["inconclusive"] else rec["recipe"]  # a busy machine: noise above the speed-up
    assert rec["recipe"] in ran and rec["reason"].startswith(named + ":")
    readme = (out / "README.md").read_text()
    assert "## Recommendation" in readme and f"Recommended (speed): {named}:" in readme
    assert f"tolerance on {rec['metric_name']}: " in readme
    for r in data["results"]:
        if r["error"] is None and not r["control"]:
            assert (out / f"{framework}_{r['recipe']}.jsonl").read_text().count("\n") >= data["spec"]["steps"]
            assert r["samples_per_s"] > 0 and r["peak_rss_mb"] == r["peak_rss_mb"] and r["params"] > 0
            assert r["state_bytes_per_param"] > 0 and r["estimate_bytes_per_param"] > 0
            assert len(r["step_windows_ms"]) >= 2
    assert (out / "loss_curves.png").stat().st_size > 0
    return data


def test_hf_gpt2_every_recipe_through_the_lightning_path(tmp_path):
    """One test, one compare (a module fixture would run once per xdist worker)."""
    pytest.importorskip("lightning")
    pytest.importorskip("transformers")
    out = tmp_path
    proc = _mpx(*HF, "--steps", "8", "--threads", "1", "--quiet", "--out", str(out))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    stdout = proc.stdout
    data = _check_report(out, list(RECIPE_NAMES), "lightning")
    assert data["spec"]["model"] == "examples.compare_hf_gpt2:make_module"
    results = {r["recipe"]: r for r in data["results"] if not r["control"]}
    assert all(r["error"] is None for r in results.values()), [r["error"] for r in results.values()]
    assert {r["metric_name"] for r in results.values()} == {"val_loss"}  # the module's validation_step logs it
    assert len({r["params"] for r in results.values()}) == 1
    base, ctl = results["32-true"], data["results"][-1]
    assert ctl["control"] and ctl["metric"] == base["metric"] and ctl["final_loss"] == base["final_loss"]
    for r in results.values():  # the same start and batches: every recipe trains like 32-true
        assert abs(r["metric"] - base["metric"]) < 0.05, r
    assert f"report written to {out}" in stdout.splitlines()[-1]
    assert "Recommended (speed): " in stdout
    # the same weights and the same first batch: step 0's loss differs by rounding only
    first = {}
    for recipe in RECIPE_NAMES:
        steps = [json.loads(line) for line in (out / f"lightning_{recipe}.jsonl").read_text().splitlines()]
        first[recipe] = [s for s in steps if "loss" in s][0]["loss"]
    assert max(first.values()) - min(first.values()) < 0.02, first  # step 0: only the rounding differs


def test_keras_hub_gpt2_through_the_keras_path(tmp_path):
    """bf16-master rebuilds the functional GPT-2 whose LM head is its backbone's token embedding (tied): the
    rebuilt model keeps it tied (20 weights, not 21) and trains like 32-true."""
    pytest.importorskip("keras_hub")
    out = tmp_path
    proc = _mpx(*KERAS_HUB, "--recipes", "bf16-master", "--steps", "6", "--threads", "1", "--quiet",
                "--out", str(out))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    stdout = proc.stdout
    data = _check_report(out, ["32-true", "bf16-master"], "keras")
    results = {r["recipe"]: r for r in data["results"] if not r["control"]}
    assert all(r["error"] is None for r in results.values())
    assert {r["metric_name"] for r in results.values()} == {"val_loss"}
    assert data["spec"]["description"].startswith("Functional 'gpt2_lm' (1,080 parameters)")
    bf16 = results["bf16-master"]  # bf16 weight + FP32 grad + master + m, v (18 B/param); FP32 layers 16
    assert bf16["state_bytes_per_param"] == pytest.approx(bf16["estimate_bytes_per_param"])
    assert 16.0 < bf16["state_bytes_per_param"] < 18.0
    assert abs(results["bf16-master"]["metric"] - results["32-true"]["metric"]) < 0.05
    share = results["bf16-master"]["diagnostics"]["low_precision_params"]
    assert 0 <= share <= 1 and (share >= 0.5 or "parameters stored in bfloat16" in (out / "README.md").read_text())
    assert "Recommended (speed): " in stdout and f"report written to {out}" in stdout


def _python(code: str, timeout: int = 240) -> dict:
    """Run ``code`` in a fresh interpreter (the runs fork from it: a test process that has run TensorFlow or
    torch kernels could deadlock a forked child) and return the JSON of its last output line."""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(), cwd=str(ROOT),
                          timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


LIGHTNING_API = """
import json, sys
from mp_callbacks.app.own_model import ModelSetupError, compare_lightning, compare_recipes
from tests.cli.own_models import make_fragile_module, make_lightning_mlp

out = {}
fragile = compare_lightning(make_fragile_module, recipes=["16-mixed", "16-master", "bf16-master"], steps=6,
                            out=sys.argv[1], threads=1)
out["fragile"] = {"errors": {r: v.error for r, v in fragile.by_recipe().items()},
                  "recipe": fragile.recommendation.recipe, "reason": fragile.recommendation.reason,
                  "others": list(fragile.recommendation.others)}
own = compare_recipes(make_lightning_mlp, recipes=["bf16-mixed"], steps=8, goal="memory", threads=1)
out["own"] = {"framework": own.spec.framework, "out": own.out, "description": own.description,
              "goal": own.recommendation.goal, "recipe": own.recommendation.recipe, "table": own.table(),
              "rows": {r: v.row() for r, v in own.by_recipe().items()}}
for name, call in (("int", lambda: compare_lightning(lambda: 42, steps=2)),
                   ("str", lambda: compare_recipes(lambda: "model", steps=2))):
    try:
        call()
    except ModelSetupError as exc:
        out[name] = str(exc)
print(json.dumps(out))
"""


def test_python_api_lightning(tmp_path):
    """compare_lightning / compare_recipes in one fresh interpreter: failed runs (an exception under bf16
    weights, a process that dies under fp16 weights) are rows never recommended; a module with its own
    train_dataloader and no validation_step compares its training loss (framework found from the factory's
    result, no out: no files); factories returning the wrong thing are clear errors."""
    pytest.importorskip("lightning")
    data = _python(LIGHTNING_API.replace("sys.argv[1]", repr(str(tmp_path))))

    errors = data["fragile"]["errors"]
    assert errors["bf16-master"] == "RuntimeError: this model refuses bfloat16 weights"
    assert errors["16-master"].startswith("the run's process died")
    assert errors["16-mixed"] is None and errors["32-true"] is None
    fragile = data["fragile"]  # on a busy machine the timing may be inconclusive: memory and the metric pick
    assert fragile["recipe"] in ("32-true", "16-mixed")
    assert "bf16-master: failed: RuntimeError: this model refuses bfloat16 weights" in data["fragile"]["others"]
    readme = (tmp_path / "README.md").read_text()
    assert "bf16-master   failed: RuntimeError: this model refuses bfloat16 weights" in readme
    assert "second line" in (tmp_path / "lightning_bf16-master_error.txt").read_text()  # the whole traceback

    own = data["own"]
    assert own["framework"] == "lightning" and own["out"] is None
    rows = own["rows"]
    assert set(rows) == {"32-true", "bf16-mixed"}
    assert {r["metric_name"] for r in rows.values()} == {"loss"}
    assert rows["32-true"]["metric"] == rows["32-true"]["final_loss"]
    assert own["goal"] == "memory" and own["recipe"] in rows
    assert rows["32-true"]["estimate_bytes_per_param"] == 12.0  # SGD with momentum: 4 weight + 4 grad + 4 buffer
    assert "TinyMLP (178 parameters)" in own["description"] and "32-true" in own["table"]

    assert "returned a 'int' object, not a LightningModule" in data["int"]
    assert "returned a 'str' object: expected a LightningModule or a Keras model" in data["str"]


KERAS_API = """
import json, sys
from mp_callbacks.app.own_model import compare_keras
from tests.cli.own_models import build_fragile_keras, make_keras_arrays

result = compare_keras(build_fragile_keras, make_keras_arrays, recipes=["bf16-mixed"], steps=5, batch_size=16,
                       out=sys.argv[1], threads=1)
print(json.dumps({"rows": {r: v.row() for r, v in result.by_recipe().items()},
                  "recipe": result.recommendation.recipe}))
"""


def test_python_api_keras_failed_recipe(tmp_path):
    """Keras: a recipe whose model cannot be built is a failed row with the error's first line."""
    pytest.importorskip("keras")
    data = _python(KERAS_API.replace("sys.argv[1]", repr(str(tmp_path))))
    rows = data["rows"]
    assert rows["bf16-mixed"]["error"] == "TypeError: cannot build under the mixed_bfloat16 policy"
    assert rows["32-true"]["error"] is None and rows["32-true"]["metric_name"] == "val_loss"
    assert data["recipe"] == "32-true"
    assert "keras      bf16-mixed    failed: TypeError: cannot build" in (tmp_path / "README.md").read_text()


@pytest.mark.parametrize("args, message", [
    (["--keras", "examples.compare_keras_hub:build_model"], "--keras needs --data pkg.module:make_dataset"),
    (["--lightning", "examples.compare_hf_gpt2:make_module", "--hidden", "8"],
     "--hidden describe the built-in model; --lightning compares your own"),
    (["--lightning", "examples.compare_hf_gpt2"], "expected PKG.MODULE:FACTORY"),
    (["--lightning", "tests.cli.own_models:nope"], "tests.cli.own_models has no attribute 'nope'"),
    (["--lightning", "examples.compare_hf_gpt2:make_module", "--data", "x:y"], "--data goes with --keras"),
    (["--lightning", "examples.compare_hf_gpt2:make_module", "--goal", "fast"], "argument --goal: invalid choice"),
])
def test_bad_own_model_flags_are_clear(args, message):
    proc = _mpx(*args, timeout=120)
    assert proc.returncode != 0
    assert message in proc.stderr, proc.stderr[-2000:]


@pytest.mark.slow
def test_keras_hub_every_recipe(tmp_path):
    """Every recipe on the keras_hub model (about 2 minutes): a recipe the adapter cannot run yet on this model
    is a failed row with its error's first line; the recommendation is one that ran."""
    pytest.importorskip("keras_hub")
    proc = _mpx(*KERAS_HUB, "--steps", "6", "--threads", "1", "--quiet", "--out", str(tmp_path), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = _check_report(tmp_path, list(RECIPE_NAMES), "keras")
    for r in data["results"]:
        assert r["error"] is None or r["error"].split(":")[0].isidentifier(), r["error"]


KERAS_ARRAYS = """
import dataclasses, json
from mp_callbacks.app import keras_model
from mp_callbacks.app.compare import ModelSpec, RunResult
from mp_callbacks.app.own_model import Described
from tests.cli.own_models import build_keras_mlp, make_keras_arrays

spec = ModelSpec("keras", model="tests.cli.own_models:build_keras_mlp", data="tests.cli.own_models:make_keras_arrays",
                 steps=4)
prepared = keras_model.prepare(build_keras_mlp, make_keras_arrays, spec)
run = RunResult.failure("keras", "32-true", "not run")
run.error, run.optimizer, run.metric_name = None, "Adam lr 0.01", "val_loss"
chosen = keras_model.prepare(build_keras_mlp, make_keras_arrays, dataclasses.replace(spec, batch_size=16))
print(json.dumps({"batch_size": prepared.batch_size, "fit": keras_model.FIT_BATCH_SIZE,
                  "train": [len(b[0]) for b in prepared.train], "val": [len(b[0]) for b in prepared.val],
                  "header": Described.of(spec, prepared, [run]).setup_line(),
                  "chosen": [chosen.batch_size, chosen.extra["batch_size_from"]]}))
"""


def test_keras_array_data_without_a_batch_size_is_cut_as_fit_cuts_it():
    """(x, y) arrays and no batch size anywhere: batches of 32 (``keras.Model.fit``'s default), said in the report's
    header; ``--batch-size`` (batch_size=) still sets it.  In a fresh interpreter (TensorFlow stays out of the test
    process, whose other tests fork)."""
    pytest.importorskip("keras")
    data = _python(KERAS_ARRAYS)
    assert data["batch_size"] == data["fit"] == 32 and data["train"] == [32] * 4 and data["val"] == [32]
    assert ("Data: tests.cli.own_models:make_keras_arrays, 96 training samples in batches of 32 (Keras fit's "
            "default; --batch-size sets it): 4 batches (cycled), 1 validation batch. Training: 4 steps of batch 32, "
            "Adam lr 0.01; compared on val_loss.") in data["header"]
    assert "None" not in data["header"]
    assert data["chosen"] == [16, "--batch-size"]
