"""Shared settings for the Lightning adapter tests: one CPU thread, quiet Lightning; the torchrun launch."""

import logging
import os
import warnings

import pytest
import torch
from filelock import FileLock

from tests.lightning.helpers.torchrun import WORKERS, done, launch, out_name


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


@pytest.fixture(scope="session")
def torchrun_out(request, tmp_path_factory):
    """``torchrun_out(__name__)`` -> the folder of that test module's two-rank results.

    One torchrun launch per test run (helpers/torchrun.py) runs the workers of every collected module that uses
    this fixture; once even if xdist hands those modules to both workers (they share the run's base temp folder,
    and a file lock lets one launch).  A module whose worker did not finish fails with the launch's output.
    """
    modules = {item.module.__name__ for item in request.session.items if "torchrun_out" in item.fixturenames}
    workers = [worker for module, (worker, _) in WORKERS.items() if module in modules]
    base = tmp_path_factory.getbasetemp()
    out = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "torchrun"
    with FileLock(f"{out}.lock"):
        if not (out / "report").exists():
            out.mkdir(exist_ok=True)
            (out / "report").write_text(launch(out, workers)[1])

    def folder(module: str):
        worker = WORKERS[module][0]
        if not done(out, worker):
            pytest.fail(f"{worker} did not finish under torchrun:\n{(out / 'report').read_text()}", pytrace=False)
        return out / out_name(worker)

    return folder
