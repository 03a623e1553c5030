"""Measure the parity bounds' margins: the real runs' values and the negative controls' values, against each bound.

Regenerates the tables of README.md ("Observed" and "Negative controls")::

    .venv/bin/python -m tests.parity.measure            # TensorFlow backend, every case (~5 min on 2 cores)
    .venv/bin/python -m tests.parity.measure --torch    # also the KERAS_BACKEND=torch cases (subprocess)

Nothing here asserts; the tests do (test_parity.py).  Every number is a ratio to its bound
(the bound is met when <= 1) and, in parentheses, in eps of the compute dtype.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def measure(case, t, k) -> dict[str, float]:
    """Worst value of each bounded quantity, as a fraction of its bound, plus the raw values in eps."""
    from . import checks
    from .runs import SGD

    eps = checks.EPS[case.compute]
    out: dict[str, float] = {}
    worst_ratio, worst_eps = 0.0, 0.0
    for side in (t, k):
        r = checks.loss_residuals(case, side)
        worst_ratio = max(worst_ratio, float(np.max(np.abs(r["resid"]) / r["bound"])))
        worst_eps = max(worst_eps, float(np.max(np.abs(r["resid"]) / np.maximum(1, np.abs(r["fp64"])))) / eps)
    out["loss_of_bound"], out["loss_eps"] = worst_ratio, worst_eps
    clean = ~np.asarray(t.overflow)
    tl, kl = np.asarray(t.losses)[clean], np.asarray(k.losses)[clean]
    out["loss_cross_eps"] = float(np.max(np.abs(tl - kl) / np.maximum(1, np.abs(tl)))) / eps
    p = np.minimum(checks.path_length(t), checks.path_length(k))
    snaps = range(case.snapshot_every - 1, case.steps, case.snapshot_every)
    state = max(float(np.linalg.norm(t.states[s].astype(np.float64) - k.states[s])) / p[s] / eps for s in snaps)
    out["state_eps"], out["state_of_bound"] = state, state / checks.state_factor(case)
    slot = 0.0
    for sa, sk in checks.pairs(t.slots, k.slots, "slots"):
        for x, y in checks.pairs(sa, sk, "slots of a parameter"):
            y = -y / SGD["lr"] if case.optimizer == "sgd" else y
            slot = max(slot, checks._rel_l2(x, y) / eps)
    out["slot_eps"], out["slot_of_bound"] = slot, slot / checks.slot_factor(case)
    return out


def _row(label: str, m: dict[str, float], case) -> str:
    from . import checks

    return (f"| {label} | {m['loss_of_bound']:.3f} ({m['loss_eps']:.2f}) | {m['state_of_bound']:.3f} "
            f"({m['state_eps']:.2f} / {checks.state_factor(case)}) | {m['slot_of_bound']:.3f} "
            f"({m['slot_eps']:.1f} / {checks.slot_factor(case)}) | {m['loss_cross_eps']:.2f} |")


def real_runs(torch_backend: bool) -> None:
    from . import runs
    from .test_parity import MLP_CASES, TRANSFORMER_FAST, TRANSFORMER_SLOW, _t
    from .test_parity_torch_backend import CASE_IDS

    print("| case | loss: of bound (eps) | state: of bound (eps·P / K_state) | slots: of bound (eps / K_slot) "
          "| cross-framework loss, eps (not bounded) |")
    print("|---|---|---|---|---|")
    cases = MLP_CASES + [_t(*c) for c in TRANSFORMER_FAST + TRANSFORMER_SLOW]
    for case in cases:
        t, k = runs.lightning_cached(case), runs.run_keras(case)
        print(_row(case.id, measure(case, t, k), case), flush=True)
    if not torch_backend:
        return
    root = Path(__file__).resolve().parents[2]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "keras_torch.npz"
        env = dict(os.environ, KERAS_BACKEND="torch", PYTHONPATH=str(root), OMP_NUM_THREADS="1")
        subprocess.run([sys.executable, "-m", "tests.parity.keras_side", str(out), *CASE_IDS], check=True,
                       env=env, cwd=str(root))
        with np.load(out, allow_pickle=False) as data:
            trajs = {c: runs.trajectory_from_arrays(data, prefix=f"{c}/") for c in CASE_IDS}
    for case_id in CASE_IDS:
        recipe, optimizer, kind = case_id.split(":")
        case = runs.Case(recipe, optimizer, kind, hidden=runs.HIDDEN[kind])
        print(_row(f"{case.id} (Keras on torch)", measure(case, runs.lightning_cached(case), trajs[case_id]), case),
              flush=True)


def controls() -> None:
    from . import checks, runs
    from .test_parity import _control_case

    print("| recipe | swapped batches: loss, of bound (eps) | LR x1.1: state, of bound (eps·P) "
          "| zeroed / doubled slot: of bound (eps) |")
    print("|---|---|---|---|")
    for recipe in runs.PARITY_RECIPES:
        case = _control_case(recipe)
        t = runs.lightning_cached(case)
        swap = measure(case, t, runs.run_keras(case, swap_batches=(32, 33)))
        lr = measure(case, t, runs.run_keras(case, lr_scale=1.1))
        eps = checks.EPS[case.compute]
        zero = 1.0 / eps  # ||0 - s|| / ||s|| = ||2s - s|| / ||s|| = 1
        print(f"| {recipe} | {swap['loss_of_bound']:.1f} ({swap['loss_eps']:.1f}) | {lr['state_of_bound']:.1f} "
              f"({lr['state_eps']:.1f}) | {zero / checks.slot_factor(case):.1f} ({zero:.0f}) |", flush=True)
    # AdamW's epsilon placement (test_tolerances_catch_adam_epsilon_placement): 32-true, eps=1e-8 on both sides.
    case = runs.Case("32-true", "adamw", "mlp", hidden=runs.HIDDEN["mlp"], steps=100)
    saved = runs.ADAMW["eps"]
    runs.ADAMW["eps"] = 1e-8
    try:
        m = measure(case, runs.run_lightning(case), runs.run_keras(case))
    finally:
        runs.ADAMW["eps"] = saved
    print(f"\nAdamW eps=1e-8 (32-true, 100 steps): state {m['state_of_bound']:.1f} of bound "
          f"({m['state_eps']:.0f} eps·P / {checks.state_factor(case)})", flush=True)


if __name__ == "__main__":
    import torch

    torch.set_num_threads(1)
    controls()
    print()
    real_runs(torch_backend="--torch" in sys.argv[1:])
