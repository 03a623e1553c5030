"""Shared settings for the Lightning adapter tests: one CPU thread, quiet Lightning."""

import logging
import warnings

import pytest
import torch


@pytest.fixture(autouse=True)
def _quiet_single_thread():
    torch.set_num_threads(1)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    logging.getLogger("lightning.fabric").setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*does not have many workers.*")
        warnings.filterwarnings("ignore", ".*is not supported by the model summary.*")
        warnings.filterwarnings("ignore", ".*GPU available but not used.*")
        yield
