"""keras_ext on Keras' JAX backend (``KERAS_BACKEND=jax``, fixed at keras import: a fresh process).

The subprocess (tests/keras/helpers/jax_backend.py, 2 host devices) runs ``model.fit`` through Keras'
JAX trainer, which applies the optimizer statelessly inside ``jit``:

* against stock Keras' ``LossScaleOptimizer`` on JAX: the same scale after every step, the same skipped
  steps and ``iterations``, weights and Adam slots equal up to XLA fusion;
* against this process's TensorFlow run of the same fit: the same scale trajectory, counters and
  ``iterations`` (the overflows come from the data: samples of 1e20);
* ``16-master`` (bf16 variables, FP32 masters in the optimizer) under ``keras.distribution.DataParallel``
  over 2 CPU devices with an inf in the second device's half of one batch: that step is skipped and the
  scale trajectory, counters and skipped step equal the one-device run's, and so do a monitor's records.

* :mod:`tests.keras.helpers.cross_backend` on both backends: ``MixedPrecisionMonitor`` on JAX logs the same
  steps, metric keys, scale trajectory, skip and overflow counts as on TensorFlow (overflows injected by inf
  sample weights, two epochs), its record rides in the optimizer's step state only while attached and is never
  saved, and the trainer's state is synced into the variables around logging steps only; the divergence rule
  stops a NaN-loss run (with and without the monitor, bf16-mixed and 16-master) and a finite-loss gradient
  overflow below scale 1 at the same step, with the same message, counters and nothing applied, as on
  TensorFlow.

``test_backend_agnostic_tests_pass_on_jax`` (marked slow: about 6 minutes here) runs the backend-agnostic
test files and Keras' own ``LossScaleOptimizer`` suite again on JAX, as test_torch_backend.py does for torch
(the monitor and divergence tests in them included).
"""

import json
import os
import subprocess
import sys

import keras
import numpy as np
import pytest

from mp_callbacks.diagnostics import METRICS, OVERFLOW_MODULE
from tests.helpers.series import SCALER_SERIES
from tests.keras.helpers import cross_backend, stock_parity
from tests.keras.helpers.util import ROOT, run_pytest
from tests.keras.test_optimizer import _assert_same

pytest.importorskip("jax")
pytestmark = [pytest.mark.skipif(keras.backend.backend() == "jax", reason="already running on the jax backend"),
              pytest.mark.xdist_group("jax_backend")]  # one worker: the module's JAX and TF runs happen once


@pytest.fixture(scope="module")
def on_jax(tmp_path_factory):
    out = tmp_path_factory.mktemp("jax") / "result.json"
    env = dict(os.environ, KERAS_BACKEND="jax", XLA_FLAGS="--xla_force_host_platform_device_count=2",
               OMP_NUM_THREADS="1", JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-m", "tests.keras.helpers.jax_backend", str(out)], capture_output=True,
                          text=True, env=env, timeout=300, cwd=str(ROOT))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["backend"] == "jax" and result["devices"] == 2
    return result


def test_fit_matches_stock_keras_on_jax(on_jax):
    _assert_same(on_jax["parity"], exact=False)  # scales, counters, iterations exact; weights up to XLA fusion


def test_jax_scale_trajectory_equals_tensorflow(on_jax):
    tf_run = stock_parity.run("ours")
    jax_run = on_jax["parity"]["ours"]
    assert jax_run["scales"] == tf_run["scales"] and jax_run["iterations"] == tf_run["iterations"]
    assert jax_run["counters"] == tf_run["counters"]  # (weights: each backend's RNG draws its own initial ones)


def test_data_parallel_over_two_devices_skips_like_one_device(on_jax):
    one, dp = on_jax["single"], on_jax["data_parallel"]
    assert "NamedSharding" in dp["sharding"] and "'batch': 2" in dp["sharding"]  # really distributed
    assert dp["dtypes"][:2] == ["bfloat16", "bfloat16"] and len(dp["masters"]) == 2  # 16-master: FP32 masters
    for key in ("scales", "skipped", "overflows", "steps", "iterations"):
        assert dp[key] == one[key], key
    assert dp["skipped"] == dp["overflows"] == 1 and dp["iterations"] == dp["steps"] - 1 == 5
    assert dp["scales"][2] == dp["scales"][1] / 2  # batch 2 (inf on the second device's half) backed off
    assert dp["monitor"] == one["monitor"] and [r[0] for r in dp["monitor"] if r[1]] == [3]  # the monitor too
    for key in ("weights", "masters"):  # bf16 compute: the sharded matmul sums partial products in another order
        for a, b in zip(dp[key], one[key]):
            assert np.all(np.isfinite(a))
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0.05, atol=2e-3)


@pytest.fixture(scope="module")
def on_tf():
    return {"monitor": cross_backend.monitor_run(), "divergence": cross_backend.divergence_runs()}


def test_monitor_on_jax_logs_what_it_logs_on_tensorflow(on_jax, on_tf):
    jax_run, tf_run = on_jax["monitor"], on_tf["monitor"]
    assert jax_run["logged_steps"] == tf_run["logged_steps"] == [5, 10, 15, 20]
    assert [sorted(r) for r in jax_run["rows"]] == [sorted(r) for r in tf_run["rows"]]
    assert set(jax_run["rows"][0]) == {m for m in METRICS if m != OVERFLOW_MODULE}  # every shared numeric name
    for name in SCALER_SERIES:  # scale and counters: exact
        assert [r[name] for r in jax_run["rows"]] == [r[name] for r in tf_run["rows"]], name
        assert jax_run["epoch"][name] == tf_run["epoch"][name], name
    assert jax_run["history"] == tf_run["history"]  # overflow steps between reads too: step, scale, counters
    assert jax_run["measured"] == tf_run["measured"]  # meters on the same steps (swamping on applied ones)
    assert sorted(jax_run["epoch"]) == sorted(tf_run["epoch"])
    for a, b in zip(jax_run["rows"], tf_run["rows"]):  # the meters: the same weights, fp16 kernels of each backend
        for name in ("mp/grad_norm", "mp/grad_underflow_frac", "mp/update_swamped_frac"):
            if a.get(name) is None or b.get(name) is None:
                assert a.get(name) == b.get(name), name
            else:
                np.testing.assert_allclose(a[name], b[name], rtol=1e-3, atol=0.01, err_msg=name)


def test_monitor_record_is_step_state_while_attached_and_never_saved(on_jax, on_tf):
    jax_run, tf_run = on_jax["monitor"], on_tf["monitor"]
    assert jax_run["detached"] and tf_run["detached"]
    assert jax_run["syncs"] == 2 * len(jax_run["logged_steps"])  # JAX: synced before and after logging steps only
    assert jax_run["saved"] == tf_run["saved"]  # the optimizer saves the same variables on both backends
    assert tf_run["step_state"] == []  # TensorFlow: nothing extra in optimizer.variables
    assert jax_run["step_state"] == ["divergence_loss_streak", "divergence_overflow_streak",
                                     "divergence_stop_step", "divergence_stop_scale"]  # the monitor's left


@pytest.mark.parametrize("case", ["bf16-mixed", "16-master", "overflow"])
def test_divergence_rule_stops_on_jax_as_on_tensorflow(on_jax, on_tf, case):
    jax_run, tf_run = on_jax["divergence"][case], on_tf["divergence"][case]
    assert jax_run == tf_run
    assert jax_run["message"] and jax_run["unchanged"] and jax_run["iterations"] == 0
    if case == "bf16-mixed":  # with a monitor attached: uninstalled before the error, overflow rows read
        assert jax_run["monitor_detached"] and jax_run["monitor_overflows"] == [1, 2, 3, 4]


def test_a_skipped_step_leaves_batchnorm_statistics_on_jax():
    """keras_ext.restore_on_skip through the JAX trainer's functional train_step (tests/keras/test_forward_state.py
    on JAX: the statistics equal a run that never saw the inf batch; without the wrap they are poisoned)."""
    names = ("test_an_inf_batch_leaves_the_statistics_of_a_run_that_never_saw_it[bf16-master-traced]",
             "test_without_the_restore_the_skipped_batch_poisons_the_statistics")  # those two, not the whole file
    proc = run_pytest(*(f"test_forward_state.py::{name}" for name in names), env={"KERAS_BACKEND": "jax"})
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    for name in names:
        assert f"test_forward_state.py::{name} PASSED" in proc.stdout, name


@pytest.mark.slow
def test_backend_agnostic_tests_pass_on_jax():
    proc = run_pytest("test_optimizer.py", "test_scaler.py", "test_masters.py", "test_saving.py", "test_policy.py",
                      "test_checkpoint.py", "test_divergence.py", "test_keras_own_suite.py",
                      env={"KERAS_BACKEND": "jax"},
                      timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "test_optimizer.py::test_fit_matches_stock_keras PASSED" in proc.stdout
    assert "test_masters.py::test_bf16_master_beats_pure_bf16_on_swamping PASSED" in proc.stdout
    assert "test_saving.py::test_save_load_resume_equals_uninterrupted[fp32-vars] PASSED" in proc.stdout
    # Keras' own suite: on JAX its stateless_apply tests run (and pass), its stateful ones skip themselves
    for name in ("test_finite_step_stateless", "test_infinite_step_stateless", "test_downscaling_stateless",
                 "test_upscaling_stateless", "test_iterations_update_stateless"):
        assert f"test_keras_own_suite.py::TestKerasOwnSuiteOnKerasExt::{name} PASSED" in proc.stdout, name
