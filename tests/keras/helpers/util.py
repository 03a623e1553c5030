"""Helpers shared by the Keras adapter tests (a uniquely named module, not conftest)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent

keras = pytest.importorskip("keras")

requires_tf_backend = pytest.mark.skipif(
    keras.backend.backend() != "tensorflow", reason="uses TensorFlow APIs (tf.GradientTape / XLA)"
)


def run_script(script: str, *args: str, env: dict | None = None, timeout: int = 240) -> subprocess.CompletedProcess:
    """Run a script of this folder in a fresh Python process (TensorFlow backend unless ``env`` says
    otherwise; the backend and the device split must be chosen before keras/TF are imported)."""
    full_env = dict(os.environ)
    full_env.update({"TF_CPP_MIN_LOG_LEVEL": "2", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT),
                     "KERAS_BACKEND": "tensorflow"})
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, str(HERE / script), *args], capture_output=True, text=True, env=full_env,
        timeout=timeout, cwd=str(ROOT),
    )
