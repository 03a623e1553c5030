"""The benchmark scripts run in-process here (``main(argv)``, tiny sizes): ``benchmarks/`` on the path, and the
process-wide settings a script changes (torch's thread count, the CPU affinity) put back after each test."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
if str(BENCHMARKS) not in sys.path:
    sys.path.insert(0, str(BENCHMARKS))

@pytest.fixture(autouse=True)
def _process_settings():
    import torch

    threads = torch.get_num_threads()
    cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    yield
    torch.set_num_threads(threads)
    if cpus is not None:
        os.sched_setaffinity(0, cpus)
