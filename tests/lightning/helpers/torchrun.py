"""One torchrun launch (2 local processes, gloo, one thread each) runs the two-process scenarios of every test
module that needs them.

A launch costs ~20 s of imports (the agent and two ranks, each importing torch and Lightning), so the modules
share one: ``python -m torch.distributed.run --standalone --nproc_per_node=2 -m tests.lightning.helpers.torchrun
OUT WORKER...`` runs each worker module's ``worker(out)`` in turn in the same two processes (one process group),
each writing to ``OUT/<name>/`` and marking ``done_rank<r>`` when it returns.  The test modules read that folder
through the session fixture ``torchrun_out`` (tests/lightning/conftest.py).
"""

from __future__ import annotations

import importlib
import os
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]

# test module -> (its worker module, seconds its scenarios may take on a loaded 2-core machine: ~5x measured)
WORKERS = {
    "tests.lightning.test_fabric_ddp": ("tests.lightning.helpers.fabric_worker", 150),
    "tests.lightning.test_scale_out": ("tests.lightning.helpers.scale_out_worker", 200),
    "tests.lightning.test_fsdp2_comm": ("tests.lightning.test_fsdp2_comm", 150),
    "tests.lightning.test_fp8_allgather": ("tests.lightning.test_fp8_allgather", 300),
}
LAUNCH_SECONDS = 120  # the agent and both ranks importing, on top of the workers' own time


def out_name(worker: str) -> str:
    """The folder of ``worker``'s results under the launch's OUT."""
    return worker.rsplit(".", 1)[-1]


def done(out: Path, worker: str) -> bool:
    """Whether both ranks finished ``worker``'s scenarios."""
    return all((out / out_name(worker) / f"done_rank{r}").exists() for r in (0, 1))


def launch(out: Path, workers: list[str]) -> tuple[int, str]:
    """Run ``workers`` in one torchrun launch; returns (exit status, output tail).

    ``--standalone``: torchrun binds its rendezvous port itself (no port picked here and bound later).  The
    launch runs in its own session: past its time limit the agent and both ranks are killed together (killing
    only the agent would leave the ranks running, holding their ports and cores).
    """
    timeout = LAUNCH_SECONDS + sum(seconds for worker, seconds in WORKERS.values() if worker in workers)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "-m", __name__, str(out), *workers]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    log = out / "torchrun.log"
    with open(log, "w") as sink:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            status, what = proc.wait(timeout=timeout), "exit status"
        except subprocess.TimeoutExpired:
            _kill_session(proc)
            status, what = -1, f"killed after {timeout} s, status"
    return status, f"torchrun {' '.join(workers)}: {what} {status}\n" + log.read_text(errors="replace")[-8000:]


def _kill_session(proc: subprocess.Popen) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):  # SIGTERM: the agent stops its ranks; SIGKILL: whatever is left
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            continue


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


def main(out: str, workers: list[str]) -> None:
    """In each rank: every worker in turn, then the process group (made by the first strategy) is destroyed."""
    import torch.distributed as dist

    rank = quiet_rank()
    for worker in workers:
        folder = Path(out) / out_name(worker)
        folder.mkdir(exist_ok=True)
        importlib.import_module(worker).worker(str(folder))
        (folder / f"done_rank{rank}").touch()
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
