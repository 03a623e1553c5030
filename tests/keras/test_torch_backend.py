"""The backend-agnostic Keras tests again with KERAS_BACKEND=torch, in a fresh pytest process.

The backend is fixed when keras is imported, so this cannot run in-process:
the optimizer (parity with stock Keras' LossScaleOptimizer, arguments, config,
recipe), the scaler, master weights, the divergence stop, save/load, resuming across recipes
and the dtype-policy mapping, all on torch.
"""

import os

import pytest

from tests.keras.helpers.util import run_pytest

FILES = ("test_optimizer.py", "test_scaler.py", "test_masters.py", "test_divergence.py", "test_saving.py",
         "test_checkpoint.py", "test_policy.py")


def test_backend_agnostic_tests_pass_on_torch():
    pytest.importorskip("torch")
    if os.environ.get("KERAS_BACKEND") == "torch":
        pytest.skip("already running on the torch backend")
    proc = run_pytest(*FILES, env={"KERAS_BACKEND": "torch"})
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and "failed" not in proc.stdout
    # The parity, master-weight and saving tests ran (not skipped) on torch.
    assert "test_optimizer.py::test_fit_matches_stock_keras PASSED" in proc.stdout
    assert "test_masters.py::test_bf16_master_beats_pure_bf16_on_swamping PASSED" in proc.stdout
    assert "test_saving.py::test_save_load_resume_equals_uninterrupted[fp32-vars] PASSED" in proc.stdout
    assert "test_checkpoint.py::test_a_master_checkpoint_resumes_bit_for_bit_under_its_recipe" \
        "[bf16-master-resume] PASSED" \
        in proc.stdout
    assert "test_divergence.py::test_nan_every_step_stops_within_ten_steps_with_nothing_applied[16-master] PASSED" \
        in proc.stdout
    assert "test_checkpoint.py::test_recipe_change_on_resume[bf16-master-16-mixed] PASSED" in proc.stdout
