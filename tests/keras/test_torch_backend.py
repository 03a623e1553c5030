"""The backend-agnostic Keras tests again with KERAS_BACKEND=torch, in a fresh pytest process.

The backend is fixed when keras is imported, so this cannot run in-process:
parity with stock Keras' LossScaleOptimizer (test_keras_parity.py), master weights,
save/load, the dtype-policy mapping and the error paths, all on torch.
"""

import os
import subprocess
import sys

import pytest
from keras_testutil import HERE, ROOT


def test_backend_agnostic_tests_pass_on_torch():
    pytest.importorskip("torch")
    if os.environ.get("KERAS_BACKEND") == "torch":
        pytest.skip("already running on the torch backend")
    env = dict(os.environ, KERAS_BACKEND="torch", PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    names = ("parity", "master", "saving", "policy", "errors")
    files = [str(HERE / f"test_keras_{name}.py") for name in names]
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-v", "-x", "-p", "no:cacheprovider", *files],
        capture_output=True, text=True, env=env, timeout=240, cwd=str(ROOT),
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and "failed" not in proc.stdout
    # The parity and master-weight tests ran (not skipped) on torch.
    assert "test_keras_parity.py::test_fit_matches_stock_keras PASSED" in proc.stdout
    assert "test_keras_master.py::test_bf16_master_beats_pure_bf16_on_swamping PASSED" in proc.stdout
    assert "test_keras_saving.py::test_save_load_resume_equals_uninterrupted[bf16-master] PASSED" in proc.stdout
