"""Quiet Lightning for the CUDA tests (no keras/tensorflow here: see helpers.py)."""

import logging
import warnings

import pytest


@pytest.fixture(autouse=True)
def _quiet():
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    logging.getLogger("lightning.fabric").setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*does not have many workers.*")
        warnings.filterwarnings("ignore", ".*GPU available but not used.*")
        warnings.filterwarnings("ignore", ".*TensorFloat32.*")
        yield
