"""Launch a test module on 2 local processes with torchrun (gloo), one thread each."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def free_port() -> int:
    """A TCP port free on localhost right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_two_ranks(module: str, out: Path, timeout: int) -> None:
    """``python -m torch.distributed.run --nproc_per_node=2 -m module out``; fails the test with the output tail."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
           "-m", module, str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]


def quiet_rank() -> int:
    """In a rank: warnings and Lightning's loggers quiet, one intra-op thread; returns the rank."""
    import logging
    import warnings

    import lightning.pytorch  # noqa: F401 - it sets its loggers' levels on import: quiet them after
    import torch

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    for name in ("lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    return int(os.environ["RANK"])
