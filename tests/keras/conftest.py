"""Shared setup of the Keras adapter tests (TensorFlow backend in-process unless KERAS_BACKEND says otherwise)."""

import os

import pytest

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

keras = pytest.importorskip("keras")


@pytest.fixture(autouse=True)
def _fresh_policy():
    """Every test starts and ends with Keras' float32 global policy (which carries no keras_ext policy)."""
    keras.config.set_dtype_policy("float32")
    yield
    keras.config.set_dtype_policy("float32")
