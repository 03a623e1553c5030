"""Lightning (``lightning_ext.MixedPrecision``) and Keras (``keras_ext.LossScaleOptimizer``) train
the same model on the same batches with the same recipe, scaler, optimizer and overflow schedule,
and take the same decisions on every step.  Tolerances and their reasons: checks.py / README.md.
"""

import numpy as np
import pytest

from mp_callbacks.recipes import RECIPE_NAMES

from . import checks, runs
from .runs import HIDDEN, Case

MLP_CASES = [Case(r, o, "mlp", hidden=HIDDEN["mlp"]) for r in RECIPE_NAMES for o in ("sgd", "adamw")]
# The transformer block: every recipe and both optimizers appear once in the fast set ...
TRANSFORMER_FAST = [("32-true", "adamw"), ("16-mixed", "sgd"), ("bf16-mixed", "adamw"), ("16-master", "adamw"),
                    ("bf16-master", "sgd")]
# ... the other five combinations are covered behaviour-wise by the MLP and the fast set.
TRANSFORMER_SLOW = [("32-true", "sgd"), ("16-mixed", "adamw"), ("bf16-mixed", "sgd"), ("16-master", "sgd"),
                    ("bf16-master", "adamw")]


def _t(recipe, opt):
    return Case(recipe, opt, "transformer", hidden=HIDDEN["transformer"])


CASES = MLP_CASES + [_t(*c) for c in TRANSFORMER_FAST] + [
    pytest.param(_t(*c), marks=pytest.mark.slow) for c in TRANSFORMER_SLOW]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_same_decisions_and_fp32_state(case):
    """200 steps with inf losses and in-layer blow-ups: exact decisions, bounded divergence."""
    t = runs.lightning_cached(case)
    k = runs.run_keras(case)
    checks.assert_parity(case, t, k)
    # The schedule exercises the scaler: many growths, many backoffs, consecutive overflows.
    growths, backoffs = t.counters[-1][3], sum(b < a for a, b in zip(t.scale, t.next_scale))
    assert growths >= 10 and backoffs >= 10, (growths, backoffs)
    assert min(t.scale) < case.scaler.init_scale < max(t.scale)
    assert t.counters[-1][1] == t.counters[-1][2] == len(set(case.inf_steps) | set(case.blowup_steps))


@pytest.mark.parametrize("recipe", ["32-true", "bf16-mixed", "bf16-master"])
def test_scaling_off_by_default_same_in_both(recipe):
    """The recipe's default scaler (off for bf16 and FP32): scale 1, nothing skipped, same state."""
    case = Case(recipe, "adamw", "mlp", hidden=HIDDEN["mlp"], scaler=None, steps=50, inf_steps=(),
                blowup_steps=())
    assert not case.recipe_obj.scaler.enabled
    t, k = runs.lightning_cached(case), runs.run_keras(case)
    checks.assert_parity(case, t, k)
    assert t.counters[-1] == (50, 0, 0, 0) and t.opt_steps[-1] == 50


@pytest.mark.parametrize("recipe", ["32-true", "bf16-mixed"])
def test_nonfinite_step_without_scaling_is_applied_in_both(recipe):
    """Scaling off: an inf loss is counted as an overflow but NOT skipped, in both frameworks.

    The non-finite gradients reach the optimizer, so the FP32 state becomes non-finite on
    both sides (this is why the bf16 recipes offer the scaler as an opt-in: with it, the
    same step is skipped, see test_same_decisions_and_fp32_state[bf16-*]).
    """
    case = Case(recipe, "sgd", "mlp", hidden=HIDDEN["mlp"], scaler=None, steps=8, inf_steps=(3,),
                blowup_steps=(), snapshot_every=8)
    t, k = runs.lightning_cached(case), runs.run_keras(case)
    checks.assert_decisions_equal(case, t, k)
    for side in (t, k):
        # Step 3 is applied with inf/NaN gradients; from then on the weights are NaN, so
        # every later step overflows too, and is applied too.
        assert side.overflow == [False] * 3 + [True] * 5
        assert side.applied == [True] * 8 and side.opt_steps == list(range(1, 9))
        assert side.counters[-1] == (8, 5, 0, 0)
        assert np.isnan(np.concatenate([a.ravel() for a in side.fp32])).any()
        assert np.all(np.isfinite(side.losses[:3])) and not np.any(np.isfinite(side.losses[3:]))


def test_without_scaling_overflows_are_counted_only_on_request_in_both():
    """Scaling off and no monitor: neither framework looks for inf/NaN (nothing is decided by it).

    Same schedule as the test above, with the adapters' default ``count_overflows=None``:
    both apply every step and count no overflow (the check is a diagnostic, on while a
    monitor is attached); the trajectories still agree step by step.
    """
    case = Case("bf16-mixed", "sgd", "mlp", hidden=HIDDEN["mlp"], scaler=None, steps=8, inf_steps=(3,),
                blowup_steps=(), snapshot_every=8, count_overflows=None)
    t, k = runs.run_lightning(case), runs.run_keras(case)
    checks.assert_decisions_equal(case, t, k)
    for side in (t, k):
        assert side.overflow == [False] * 8
        assert side.applied == [True] * 8 and side.counters[-1] == (8, 0, 0, 0)
        assert not np.any(np.isfinite(side.losses[3:]))


def test_keras_fit_equals_train_on_batch():
    """The Keras side uses train_on_batch (per-step losses); model.fit runs the same train step."""
    case = Case("16-mixed", "sgd", "mlp", hidden=HIDDEN["mlp"], steps=40, snapshot_every=40)
    by_batch, by_fit = runs.run_keras(case), runs.run_keras(case, use_fit=True)
    for name in ("scale", "next_scale", "overflow", "applied", "counters", "opt_steps"):
        assert getattr(by_batch, name) == getattr(by_fit, name), name
    for a, b in zip(by_batch.fp32 + by_batch.low, by_fit.fp32 + by_fit.low):
        np.testing.assert_array_equal(a, b)


def test_tolerances_catch_one_wrong_step():
    """Negative control: Keras trains two clean batches in swapped order (steps 32 and 33).

    The decisions stay identical (no overflow is involved), but the per-step loss bound
    fails (observed ~37 eps against 16): the loss check resolves a single wrong step.
    (The final weights barely notice a swap of two consecutive SGD steps.)
    """
    case = Case("16-mixed", "sgd", "mlp", hidden=HIDDEN["mlp"], steps=50)
    t, k = runs.lightning_cached(case), runs.run_keras(case, swap_batches=(32, 33))
    checks.assert_decisions_equal(case, t, k)
    with pytest.raises(AssertionError, match="loss differs"):
        checks.assert_parity(case, t, k)


def test_tolerances_catch_adam_epsilon_placement(monkeypatch):
    """Negative control: AdamW with eps=1e-8 on both sides under 32-true.

    torch adds eps to sqrt(v_hat), Keras to sqrt(v): with a non-negligible eps the two
    optimizers are not the same function, and the FP32 state bound catches it
    (observed ~5000 eps against 128); the suite's eps=1e-12 makes them coincide.
    """
    monkeypatch.setitem(runs.ADAMW, "eps", 1e-8)
    case = Case("32-true", "adamw", "mlp", hidden=HIDDEN["mlp"], steps=100)
    t, k = runs.run_lightning(case), runs.run_keras(case)  # not cached: other hyperparameters
    checks.assert_decisions_equal(case, t, k)
    with pytest.raises(AssertionError, match="loss differs|FP32 state"):
        checks.assert_parity(case, t, k)
