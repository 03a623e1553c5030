"""The Keras side again with KERAS_BACKEND=torch (fixed at keras import: a fresh process).

The subprocess runs :mod:`tests.parity.keras_side` for a set of cases covering every
recipe and both optimizers and models; this process compares its trajectories with
the Lightning runs under the same guarantees and tolerances as on TensorFlow.  The same
process also runs the Keras side of the ``fp8-mixed`` parity test (``test_fp8_parity.py``).
"""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from . import checks, runs, test_fp8_parity

ROOT = Path(__file__).resolve().parents[2]
CASE_IDS = ["32-true:sgd:mlp", "16-mixed:adamw:mlp", "bf16-mixed:sgd:mlp", "16-master:sgd:transformer",
            "bf16-master:adamw:transformer"]


def test_keras_side_on_torch_backend_matches_lightning(tmp_path):
    if os.environ.get("KERAS_BACKEND") == "torch":
        pytest.skip("the suite already runs its Keras side on the torch backend")
    out = tmp_path / "keras_torch.npz"
    env = dict(os.environ, KERAS_BACKEND="torch", PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "tests.parity.keras_side", str(out), *CASE_IDS, "fp8"],
                          capture_output=True, text=True, env=env, timeout=300, cwd=str(ROOT))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with np.load(out, allow_pickle=False) as result:
        assert str(result["backend"]) == "torch"
        keras_trajs = {c: runs.trajectory_from_arrays(result, prefix=f"{c}/") for c in CASE_IDS}
        keras_fp8 = {k[len("fp8/"):]: result[k] for k in result.files if k.startswith("fp8/")}
    for case_id in CASE_IDS:
        recipe, optimizer, kind = case_id.split(":")
        case = runs.Case(recipe, optimizer, kind, hidden=runs.HIDDEN[kind])
        checks.assert_parity(case, runs.lightning_cached(case), keras_trajs[case_id])
    test_fp8_parity.assert_fp8_parity(test_fp8_parity.lightning_cached(), keras_fp8)  # fp8-mixed, Keras on torch
