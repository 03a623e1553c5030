"""Lightning (``lightning_ext.MixedPrecision``) and Keras (``keras_ext.LossScaleOptimizer``) train
the same model on the same batches with the same recipe, scaler, optimizer and overflow schedule,
and take the same decisions on every step.  Bounds and their derivations: checks.py / README.md.
"""

import dataclasses

import numpy as np
import pytest

from mp_callbacks.loss_scale import ScalerConfig
from mp_callbacks.recipes import RECIPE_NAMES

from . import checks, harness, runs
from .runs import HIDDEN, PARITY_RECIPES, Case

MLP_CASES = [Case(r, o, "mlp", hidden=HIDDEN["mlp"]) for r in PARITY_RECIPES for o in ("sgd", "adamw")]
# The transformer block: every recipe and both optimizers appear once in the fast set ...
TRANSFORMER_FAST = [("32-true", "adamw"), ("16-mixed", "sgd"), ("bf16-mixed", "adamw"), ("16-master", "adamw"),
                    ("bf16-master", "sgd")]
# ... the other five combinations are covered behaviour-wise by the MLP and the fast set.
TRANSFORMER_SLOW = [("32-true", "sgd"), ("16-mixed", "adamw"), ("bf16-mixed", "sgd"), ("16-master", "sgd"),
                    ("bf16-master", "adamw")]


# Scaling off, and non-finite steps applied rather than skipped (the opt-out of the default).
_OFF_APPLY_ALL = ScalerConfig(enabled=False, skip_nonfinite=False)


def _t(recipe, opt):
    return Case(recipe, opt, "transformer", hidden=HIDDEN["transformer"])


CASES = MLP_CASES + [_t(*c) for c in TRANSFORMER_FAST] + [
    pytest.param(_t(*c), marks=pytest.mark.slow) for c in TRANSFORMER_SLOW]


def test_recipes_outside_the_parity_matrix():
    """Every recipe is in the matrix except the two without FP32 state and fp8-mixed (its own test,
    test_fp8_parity.py), named here on purpose."""
    assert PARITY_RECIPES == ("32-true", "16-mixed", "bf16-mixed", "16-master", "bf16-master")
    assert set(RECIPE_NAMES) - set(PARITY_RECIPES) == {"bf16-kahan", "bf16-sr", "fp8-mixed"}


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_same_decisions_and_fp32_state(case):
    """200 steps with inf losses and in-layer blow-ups: exact decisions, bounded divergence."""
    t = runs.lightning_cached(case)
    k = runs.keras_cached(case)
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
def test_nonfinite_step_without_scaling_is_skipped_in_both(recipe):
    """Scaling off (the recipe's default scaler): an inf loss is counted and its step skipped, in both
    frameworks (``skip_nonfinite``, on by default): nothing non-finite reaches the weights."""
    case = Case(recipe, "sgd", "mlp", hidden=HIDDEN["mlp"], scaler=None, steps=8, inf_steps=(3,),
                blowup_steps=(), snapshot_every=8)
    assert not case.recipe_obj.scaler.enabled and case.recipe_obj.scaler.skip_nonfinite
    t, k = runs.lightning_cached(case), runs.run_keras(case)
    checks.assert_parity(case, t, k)
    for side in (t, k):
        assert side.overflow == [False] * 3 + [True] + [False] * 4
        assert side.applied == [True] * 3 + [False] + [True] * 4 and side.opt_steps[-1] == 7
        assert side.counters[-1] == (8, 1, 1, 0) and set(side.scale) == {1.0}
        np.testing.assert_array_equal(side.states[3], side.states[2])  # the skipped step left the weights


@pytest.mark.parametrize("recipe", ["32-true", "bf16-mixed"])
def test_nonfinite_step_with_skip_nonfinite_off_is_applied_in_both(recipe):
    """Scaling off and ``skip_nonfinite=False``: an inf loss is counted as an overflow but NOT skipped.

    The non-finite gradients reach the optimizer, so the FP32 state becomes non-finite on
    both sides, identically.
    """
    case = Case(recipe, "sgd", "mlp", hidden=HIDDEN["mlp"], scaler=_OFF_APPLY_ALL, steps=8, inf_steps=(3,),
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
    """Scaling off, ``skip_nonfinite=False`` and no monitor: neither framework looks for inf/NaN.

    Same schedule as the test above, with the adapters' default ``count_overflows=None``:
    nothing is decided by the check, so it runs only while a monitor is attached; both
    apply every step and count no overflow; the trajectories still agree step by step.
    """
    case = Case("bf16-mixed", "sgd", "mlp", hidden=HIDDEN["mlp"], scaler=_OFF_APPLY_ALL, steps=8,
                inf_steps=(3,), blowup_steps=(), snapshot_every=8, count_overflows=None)
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
    for a, b in checks.pairs(by_batch.fp32 + by_batch.low, by_fit.fp32 + by_fit.low, "fp32 + low arrays"):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(np.stack(by_batch.states), np.stack(by_fit.states))


def test_fp64_reference_is_the_torch_model():
    """The FP64 loss that the loss bound compares with is torch_model's loss, for both models."""
    import torch

    for kind in ("mlp", "transformer"):
        module = harness.torch_model(kind, hidden=HIDDEN[kind], seed=0).double()
        weights = harness.torch_weights_in_keras_order(module, kind)
        rng = np.random.default_rng(0)
        states = np.stack([np.concatenate([a.ravel() for a in weights]) * (1 + 0.1 * i * rng.standard_normal())
                           for i in range(3)])
        b = harness.digits_batches(3, 32)
        losses, sens = harness.fp64_losses(kind, [a.shape for a in weights], states, b.x, b.y, b.w)
        for i in range(3):
            values = iter(np.split(states[i], np.cumsum([a.size for a in weights])[:-1]))
            with torch.no_grad():
                for path in harness.layer_map(kind):
                    for p in (q for q in (module.get_submodule(path).weight, module.get_submodule(path).bias)
                              if q is not None):
                        v = torch.tensor(next(values), dtype=torch.float64)
                        p.copy_(v.reshape(p.shape[::-1]).T if p.ndim == 2 else v.reshape(p.shape))
                logits = module(torch.tensor(b.x[i], dtype=torch.float64))
                want = (torch.nn.functional.cross_entropy(logits, torch.tensor(b.y[i]), reduction="none")
                        * torch.tensor(b.w[i], dtype=torch.float64)).sum() / 32
            assert abs(losses[i] - float(want)) < 1e-12, (kind, i, losses[i], float(want))
        assert np.all(sens > 0) and np.all(np.isfinite(sens))


# -- negative controls: each deliberate defect fails its bound, under every recipe ------------------
#
# On the MLP with SGD; the swap and the learning rate on 35-step runs (the swap is at steps 32/33,
# the learning rate shows at the first state comparison, step 25), the slots on the 200-step runs
# of the matrix.  tests/parity/measure.py prints each fault's value against its bound.

CONTROL_STEPS = 35


def _control_case(recipe: str) -> Case:
    return Case(recipe, "sgd", "mlp", hidden=HIDDEN["mlp"], steps=CONTROL_STEPS)


@pytest.mark.parametrize("recipe", PARITY_RECIPES)
def test_swapped_batches_fail_the_loss_bound(recipe):
    """Keras trains batches 32 and 33 in swapped order: same decisions, but its reported loss
    at step 32 is another batch's loss, far outside the rounding bound (the README's table)."""
    case = _control_case(recipe)
    t, k = runs.lightning_cached(case), runs.run_keras(case, swap_batches=(32, 33))
    checks.assert_decisions_equal(case, t, k)
    with pytest.raises(AssertionError, match="keras's loss at step 3[23]"):
        checks.assert_losses(case, t, k)


@pytest.mark.parametrize("recipe", PARITY_RECIPES)
def test_learning_rate_ten_percent_high_fails_the_state_bound(recipe):
    """Keras' inner optimizer gets 1.1 x the learning rate: every update is 10% longer, and the
    FP32 states part by ~0.1 x the path length, far outside K_state eps (the README's table).
    Each framework's loss is still the loss of its own weights: the loss check passes."""
    case = _control_case(recipe)
    t, k = runs.lightning_cached(case), runs.run_keras(case, lr_scale=1.1)
    checks.assert_decisions_equal(case, t, k)
    checks.assert_losses(case, t, k)
    with pytest.raises(AssertionError, match="FP32 state at step 25 "):
        checks.assert_states(case, t, k)


@pytest.mark.parametrize("recipe", PARITY_RECIPES)
def test_zeroed_doubled_or_missing_slot_or_master_fails(recipe):
    """The real run passes; a zeroed or doubled slot of any parameter, a missing slot and a
    missing master fail (a shorter list is an error, never zipped away)."""
    case = Case(recipe, "sgd", "mlp", hidden=HIDDEN["mlp"])
    t, k = runs.lightning_cached(case), runs.keras_cached(case)
    checks.assert_slots(case, t, k)
    for i in range(len(k.slots)):
        for factor in (0.0, 2.0):
            slots = [list(s) for s in k.slots]
            slots[i] = [factor * s for s in slots[i]]
            with pytest.raises(AssertionError, match=f"slot 0 of parameter {i} differs"):
                checks.assert_slots(case, t, dataclasses.replace(k, slots=slots))
    with pytest.raises(AssertionError, match="parameters with slots: lightning has 6, keras 5"):
        checks.assert_slots(case, t, dataclasses.replace(k, slots=k.slots[:-1]))
    with pytest.raises(AssertionError, match="parameter 5 has 1 / 0 slots"):
        checks.assert_slots(case, t, dataclasses.replace(k, slots=k.slots[:-1] + [[]]))
    with pytest.raises(AssertionError, match="FP32 state arrays: lightning has 6, keras 5"):
        checks.assert_same_layout(case, t, dataclasses.replace(k, fp32=k.fp32[:-1]))


def test_tolerances_catch_adam_epsilon_placement(monkeypatch):
    """Negative control: AdamW with eps=1e-8 on both sides under 32-true.

    torch adds eps to sqrt(v_hat), Keras to sqrt(v): with a non-negligible eps the two
    optimizers are not the same function, and the FP32 state bound catches it (the
    README's table); the suite's eps=1e-12 makes them coincide.
    """
    monkeypatch.setitem(runs.ADAMW, "eps", 1e-8)
    case = Case("32-true", "adamw", "mlp", hidden=HIDDEN["mlp"], steps=100)
    t, k = runs.run_lightning(case), runs.run_keras(case)  # not cached: other hyperparameters
    checks.assert_decisions_equal(case, t, k)
    with pytest.raises(AssertionError, match="FP32 state"):
        checks.assert_parity(case, t, k)
