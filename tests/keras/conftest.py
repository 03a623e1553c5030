"""Shared setup of the Keras adapter tests (TensorFlow backend in-process unless KERAS_BACKEND says otherwise)."""

import os
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent.parent))
os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

keras = pytest.importorskip("keras")


@pytest.fixture(autouse=True)
def _fresh_policy():
    """Every test starts and ends with Keras' float32 global policy and no active keras_ext policy."""
    from keras_ext import policy as kp

    keras.config.set_dtype_policy("float32")
    kp._ACTIVE.update(policy=None, recipe=None)
    yield
    keras.config.set_dtype_policy("float32")
    kp._ACTIVE.update(policy=None, recipe=None)
