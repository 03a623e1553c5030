"""Paths, markers and the subprocess runner of the Keras adapter tests."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]
"""tests/keras/"""
ROOT = TESTS.parents[1]
"""The repository root."""

keras = pytest.importorskip("keras")

requires_tf_backend = pytest.mark.skipif(
    keras.backend.backend() != "tensorflow", reason="uses TensorFlow APIs (tf.GradientTape / XLA)"
)

def run_script(name: str, *args: str, env: dict | None = None, timeout: int = 240) -> subprocess.CompletedProcess:
    """Run ``python -m tests.keras.helpers.<name>`` in a fresh process from the repository root
    (TensorFlow backend unless ``env`` says otherwise; the backend and the device split must be
    chosen before keras/TF are imported)."""
    full_env = dict(os.environ)
    full_env.update({"TF_CPP_MIN_LOG_LEVEL": "2", "OMP_NUM_THREADS": "1", "KERAS_BACKEND": "tensorflow"})
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", f"tests.keras.helpers.{name}", *args], capture_output=True, text=True,
        env=full_env, timeout=timeout, cwd=str(ROOT),
    )


def run_pytest(*files: str, env: dict | None = None, timeout: int = 240) -> subprocess.CompletedProcess:
    """``python -m pytest -v -x`` on test files of this folder in a fresh process from the repository root."""
    full_env = dict(os.environ, OMP_NUM_THREADS="1", **(env or {}))
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-v", "-x", "-p", "no:cacheprovider", *(str(TESTS / f) for f in files)],
        capture_output=True, text=True, env=full_env, timeout=timeout, cwd=str(ROOT),
    )
