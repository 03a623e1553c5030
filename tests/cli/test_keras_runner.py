"""mp_callbacks/app/keras_runner.py: the Keras runner of ``mpx compare`` (in-process, and on the torch backend)."""

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
keras = pytest.importorskip("keras")

import keras_ext  # noqa: E402
from mp_callbacks.app import keras_runner as kc  # noqa: E402
from mp_callbacks.app.compare import RunSpec  # noqa: E402

from .baseline import check_against_baseline  # noqa: E402

# One xdist worker runs this module, so its module-scoped runs happen once under --dist loadgroup.
pytestmark = pytest.mark.xdist_group("keras_runner")

ROOT = Path(__file__).resolve().parents[2]
# Long enough to learn (lr 1e-2), so that each recipe can be compared with the 32-true run.
SPEC = RunSpec(steps=30, batch_size=16, hidden=24, depth=2, inject=(3,), lr=1e-2)
PARAMS = 64 * 24 + 24 + 24 * 24 + 24 + 24 * 10 + 10


@pytest.fixture(autouse=True)
def _float32_global_policy():
    """Every test starts and ends with Keras' float32 global policy."""
    keras.config.set_dtype_policy("float32")
    yield
    keras.config.set_dtype_policy("float32")


@functools.cache
def _run(recipe: str):
    keras.config.set_dtype_policy("float32")
    return kc.run(recipe, SPEC)


@pytest.mark.parametrize("recipe", ["16-mixed", "bf16-master"])
def test_run_measures_and_skips(recipe):
    result = _run(recipe)
    assert result.framework == "keras" and result.recipe == recipe and result.params == PARAMS
    assert result.overflows == 1 and result.skipped == 1
    assert len(result.history) == SPEC.steps
    assert [s.step for s in result.history if s.overflow] == [3]
    assert result.history[3].skipped_total == 1 and not np.isfinite(result.history[3].loss)
    assert result.step_time_ms > 0 and result.samples_per_s > 0
    # Measured = estimate: weights + one grad per trainable (FP32 on masters) + FP32 masters + Adam m, v.
    assert result.state_bytes_per_param == pytest.approx(result.estimate_bytes_per_param)
    if recipe == "16-mixed":  # torch preset: the overflow step ran at 2**16, then backed off
        assert result.history[3].scale == 2.0**16 and result.history[4].scale == 2.0**15


@pytest.mark.parametrize("recipe", ["16-mixed", "bf16-master"])
def test_run_trains_like_32_true(recipe):
    check_against_baseline(_run(recipe).row(), _run("32-true").row())


def test_state_bytes_counts_masters_and_slots():
    model, opt, _ = kc.fit_once("bf16-master", RunSpec(steps=2, batch_size=8, hidden=8, depth=1))
    hidden = 64 * 8 + 8  # bf16 Dense; the output Dense(10) is kept in FP32 by the policy
    out = 8 * 10 + 10
    assert [v.dtype for v in model.trainable_variables] == ["bfloat16", "bfloat16", "float32", "float32"]
    assert sum(m is not None for m in opt.master_variables) == 2
    # The step widens every bf16 gradient to FP32 before the inner optimizer runs: at the step the model holds
    # bf16 weight + FP32 grad + FP32 master + m, v (18 B/param).
    assert opt.fp32_master_grads
    grad = 4
    expected = hidden * (2 + grad + 4 + 8) + out * (4 + 4 + 8)
    assert kc.state_bytes(model, opt) == expected


def test_global_policy_is_restored():
    keras_ext.set_global_policy("bf16-mixed")
    before = keras_ext.get_global_policy()
    model, _, _ = kc.fit_once("16-master", RunSpec(steps=2, batch_size=8, hidden=8, depth=1))
    assert model.layers[0].dtype_policy.name == "float16"  # the run used its own recipe
    assert keras.config.dtype_policy().name == "mixed_bfloat16"
    assert keras_ext.get_global_policy() is before


@pytest.mark.skipif(keras.backend.backend() != "tensorflow", reason="Grappler options: TensorFlow backend")
def test_graph_options_restore_the_remapper():
    import tensorflow as tf

    tf.config.optimizer.set_experimental_options({"remapping": True})
    with kc.graph_options():
        assert tf.config.optimizer.get_experimental_options()["remapping"] is False
    assert tf.config.optimizer.get_experimental_options()["remapping"] is True


def test_runner_on_torch_backend():
    pytest.importorskip("torch")
    if keras.backend.backend() == "torch":
        pytest.skip("covered in-process")
    script = (
        "import json, keras\n"
        "from mp_callbacks.app.keras_runner import run\n"
        "from mp_callbacks.app.compare import RunSpec\n"
        "spec = RunSpec(steps=30, batch_size=16, hidden=16, depth=1, inject=(2,), lr=1e-2)\n"
        "rows = [run(r, spec).row() for r in ('32-true', '16-mixed', 'bf16-master')]\n"
        "print(json.dumps({'backend': keras.backend.backend(), 'rows': rows}))\n"
    )
    env = dict(os.environ, KERAS_BACKEND="torch", PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=240,
                          cwd=str(ROOT))
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(proc.stdout.strip().splitlines()[-1])
    assert data["backend"] == "torch"
    rows = {row["recipe"]: row for row in data["rows"]}
    for row in data["rows"]:
        assert row["overflows"] == 1 and row["skipped"] == 1, row
        check_against_baseline(row, rows["32-true"])
        assert row["state_bytes_per_param"] == pytest.approx(row["estimate_bytes_per_param"])
