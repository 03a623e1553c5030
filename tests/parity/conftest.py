"""Parity suite setup: the Keras side runs on TensorFlow in-process unless KERAS_BACKEND says otherwise."""

import logging
import os
import warnings

import pytest

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

pytest.importorskip("torch")
pytest.importorskip("lightning")
pytest.importorskip("keras")
pytest.importorskip("sklearn")


@pytest.fixture(autouse=True)
def _quiet_single_thread():
    import keras
    import torch


    torch.set_num_threads(1)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    logging.getLogger("lightning.fabric").setLevel(logging.ERROR)
    keras.config.set_dtype_policy("float32")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*does not have many workers.*")
        warnings.filterwarnings("ignore", ".*LeafSpec.*")
        yield
    keras.config.set_dtype_policy("float32")
