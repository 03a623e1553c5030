"""The Keras side of the parity suite on KERAS_BACKEND=jax (fixed at keras import: a fresh process).

As test_parity_torch_backend.py: the subprocess runs :mod:`tests.parity.keras_side` (``train_on_batch``
through Keras' JAX trainer, the optimizer applied statelessly inside ``jit``) and this process compares
its trajectories (scale, overflow and skip steps, counters, states) with the Lightning runs under the
same guarantees and tolerances as on TensorFlow.  Marked slow (minutes here: JAX compiles each case's
steps); test_jax_backend.py covers the JAX trajectory against stock Keras and TensorFlow in seconds.
"""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from . import checks, runs

ROOT = Path(__file__).resolve().parents[2]
CASE_IDS = ["16-mixed:adamw:mlp", "16-master:sgd:transformer"]


@pytest.mark.slow
def test_keras_side_on_jax_backend_matches_lightning(tmp_path):
    pytest.importorskip("jax")
    if os.environ.get("KERAS_BACKEND") == "jax":
        pytest.skip("the suite already runs its Keras side on the jax backend")
    out = tmp_path / "keras_jax.npz"
    env = dict(os.environ, KERAS_BACKEND="jax", JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "tests.parity.keras_side", str(out), *CASE_IDS],
                          capture_output=True, text=True, env=env, timeout=900, cwd=str(ROOT))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with np.load(out, allow_pickle=False) as result:
        assert str(result["backend"]) == "jax"
        keras_trajs = {c: runs.trajectory_from_arrays(result, prefix=f"{c}/") for c in CASE_IDS}
    for case_id in CASE_IDS:
        recipe, optimizer, kind = case_id.split(":")
        case = runs.Case(recipe, optimizer, kind, hidden=runs.HIDDEN[kind])
        checks.assert_parity(case, runs.lightning_cached(case), keras_trajs[case_id])
