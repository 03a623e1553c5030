"""How far a recipe's final loss and accuracy may sit from the ``32-true`` run of the same comparison.

``mpx compare`` trains a small MLP on scikit-learn's digits (ten classes).  An untrained model
predicts uniformly: cross-entropy ``ln 10``, accuracy about ``1/10``.  The ``32-true`` run's
*progress* is how far it got from there.  A recipe passes when its loss and accuracy are within
``FRACTION`` of that progress of the ``32-true`` values.

Why a quarter of the progress: every recipe sees the same batches, skips the same injected step
and starts from the same weights, rounded to its storage dtype (both frameworks, every
recipe: tests/cli/test_runners_same_start.py).  From there a correct low-precision recipe follows the FP32
learning curve up to rounding (unit roundoff 2**-11 for fp16, 2**-8 for bf16, per operation):
on the sizes used here that moves loss and accuracy by about 2% of the progress.  A quarter
leaves room for trajectories that drift apart over a run, and still fails a recipe that does not
learn (no progress), diverges (a non-finite loss), or trains at a markedly different rate.
The same margin serves for the two frameworks' ``32-true`` runs (different initializers).
"""

from __future__ import annotations

import math

UNTRAINED_LOSS = math.log(10.0)
CHANCE_ACCURACY = 0.1
FRACTION = 0.25
MIN_BASELINE_ACCURACY = 2 * CHANCE_ACCURACY
"""The baseline must have learned something (at least twice chance), else the margins are vacuous."""


def check_baseline(base: dict) -> None:
    """The ``32-true`` row learned: finite loss below an untrained model's, accuracy above twice chance."""
    assert math.isfinite(base["final_loss"]) and base["final_loss"] < UNTRAINED_LOSS, base
    assert base["accuracy"] > MIN_BASELINE_ACCURACY, base


def check_against_baseline(row: dict, base: dict) -> None:
    """``row``'s final loss and accuracy are within ``FRACTION`` of ``base``'s progress of ``base``'s values."""
    check_baseline(base)
    loss_margin = FRACTION * (UNTRAINED_LOSS - base["final_loss"])
    acc_margin = FRACTION * (base["accuracy"] - CHANCE_ACCURACY)
    assert math.isfinite(row["final_loss"]), row
    assert abs(row["final_loss"] - base["final_loss"]) <= loss_margin, (row, base, loss_margin)
    assert abs(row["accuracy"] - base["accuracy"]) <= acc_margin, (row, base, acc_margin)
