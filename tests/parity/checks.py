"""What "parity" means, as assertions with stated bounds (see README.md for the derivations).

Exactly equal (``==`` on every step): the scale each step's loss was multiplied
by, the scale after the step, the overflow flag, the applied/skipped decision,
the counters (steps, overflows, skipped, growths) and the optimizer's own step
count.  Both also equal the core's NumPy reference evaluated on the same flags.

Within bounds.  ``eps`` is the machine epsilon of the recipe's *compute* dtype
(float32 2**-23, float16 2**-10, bfloat16 2**-7), ``eps32`` float32's:

* **loss** (every applied step, each framework): the reported loss minus the FP64
  loss of the FP32 weights that framework held before the step, on the step's
  batch (:func:`harness.fp64_losses`), is at most
  ``eps * S_t + K_LOSS32 * eps32 * max(1, |l|)``.  ``S_t`` is the first-order
  sensitivity of that loss to one relative error of ``eps`` in every value the
  compute dtype rounds (counted per rounding); the second term is the FP32 part
  (head, cross-entropy, batch mean).  A wrong batch changes the loss by the
  difference of two batches' losses, not by a rounding.
* **FP32 state** (masters, or FP32 parameters), every ``snapshot_every`` steps:
  ``||w_lightning - w_keras|| <= K_state * eps * P_t``, where ``P_t`` is the path
  length ``sum_s ||w_(s+1) - w_s||`` (the smaller of the two frameworks'): each step's
  update differs by at most ``K_state * eps`` of itself, and in the worst case
  these differences add up.  ``K_state`` is 3 for float16/bfloat16 compute
  (two roundings on a gradient's path that may differ, each < 1.5 eps: torch
  rounds to nearest, TensorFlow's bfloat16 MatMul truncates), 16 for float32 with
  SGD and 128 for float32 with AdamW (float32 accumulation order; Adam divides every
  coordinate by its RMS gradient and magnifies it).
* **optimizer slots** (momentum; Adam m and v, all FP32), per parameter at the
  end: ``||ds|| / ||s|| <= K_slot * eps``; ``K_slot`` is 32 for float16/bfloat16,
  8x ``K_state`` for float32.  A zeroed, doubled or sign-flipped slot is off by 1 or
  more (128 eps of bfloat16).
* ``*-master`` low-precision copies: each side's copies are its rounded masters
  (bitwise); across frameworks ``|d copy| <= |d master| + eps_storage * |master|``
  (+ the subnormal spacing) per element (rounding two values moves them apart by at
  most one rounding of each), and in L2 the FP32 masters agree more tightly than the copies.

Every list of per-parameter arrays (masters, copies, slots) is compared pairwise
only after checking that both frameworks have the same number of them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from mp_callbacks.loss_scale import initial_state, next_state

from . import harness
from .runs import SGD, Case, Trajectory

EPS = {"float32": 2.0**-23, "float16": 2.0**-10, "bfloat16": 2.0**-7}
TINY = {"float32": 2.0**-149, "float16": 2.0**-24, "bfloat16": 2.0**-133}  # subnormal spacing: absolute rounding
K_LOSS32 = 16  # the loss's own FP32 arithmetic (head, log-softmax, batch mean), relative to max(1, |l|)
K_STATE_LOW = 3  # float16/bfloat16 compute: a step's update differs by < 3 eps of itself
K_STATE_FP32 = {"sgd": 16, "adamw": 128}  # float32 compute: accumulation order (x Adam's normalization)
K_SLOT_LOW = 32  # float16/bfloat16: the last gradients, at the end of training, and what dw does to them
SLOT_OVER_STATE_FP32 = 8


def state_factor(case: Case) -> int:
    """``K_state`` of ``case`` (see the module docstring)."""
    return K_STATE_FP32[case.optimizer] if case.compute == "float32" else K_STATE_LOW


def slot_factor(case: Case) -> int:
    """``K_slot`` of ``case``."""
    return SLOT_OVER_STATE_FP32 * K_STATE_FP32[case.optimizer] if case.compute == "float32" else K_SLOT_LOW


def pairs(a: Sequence, b: Sequence, what: str) -> list[tuple[Any, Any]]:
    """``zip(a, b)`` after asserting equal lengths (a missing parameter/slot is an error, not dropped)."""
    assert len(a) == len(b), f"{what}: lightning has {len(a)}, keras {len(b)}"
    return list(zip(a, b))


def _first_difference(a: list, b: list) -> str:
    if len(a) != len(b):
        return f"lengths {len(a)} != {len(b)}"
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return f"step {i}: lightning {x!r} != keras {y!r}"
    return "equal"


def _rel_l2(a: np.ndarray, b: np.ndarray) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    norm = float(np.linalg.norm(a.astype(np.float64)))
    return float(np.linalg.norm(a.astype(np.float64) - b.astype(np.float64))) / max(norm, 1e-30)


def _round_to(x: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "float32":
        return x
    if dtype == "float16":
        return x.astype(np.float16).astype(np.float32)
    import ml_dtypes

    return x.astype(ml_dtypes.bfloat16).astype(np.float32)


def reference_scales(case: Case, overflow: list[bool]) -> tuple[list[float], list[float], list[tuple]]:
    """The core's NumPy transition on the same overflow flags: (scale used, scale after, counters)."""
    config = case.recipe_obj.scaler
    state = initial_state(config)
    used, after, counters = [], [], []
    for flag in overflow:
        used.append(float(state.scale))
        state, _ = next_state(config, state, np.bool_(flag))
        after.append(float(state.scale))
        counters.append((int(state.steps), int(state.overflows), int(state.skipped), int(state.growths)))
    return used, after, counters


def assert_decisions_equal(case: Case, t: Trajectory, k: Trajectory) -> None:
    """The exact part: scale trajectory, overflow/skip decisions, counters, optimizer step counts."""
    for name in ("scale", "next_scale", "overflow", "applied", "counters", "opt_steps"):
        a, b = getattr(t, name), getattr(k, name)
        assert a == b, f"{case.id}: {name} differs: {_first_difference(a, b)}"
    used, after, counters = reference_scales(case, t.overflow)
    assert t.scale == used and t.next_scale == after and t.counters == counters, \
        f"{case.id}: the adapters' scale trajectory is not the core's"
    assert len(t.overflow) == case.steps
    applied_so_far = np.cumsum(t.applied).tolist()
    assert t.opt_steps == applied_so_far, f"{case.id}: optimizer steps != applied steps"
    config = case.recipe_obj.scaler
    if config.enabled:
        expected = sorted(set(case.inf_steps) | set(case.blowup_steps))
        expected = [s for s in expected if s < case.steps]
        assert np.nonzero(t.overflow)[0].tolist() == expected, f"{case.id}: overflow steps != the schedule"
    else:
        assert set(t.scale) == {1.0}, f"{case.id}: scaling off must use scale 1"
    if config.can_skip:  # scaling on, or off with skip_nonfinite (the default)
        assert t.applied == [not o for o in t.overflow], f"{case.id}: a skip without overflow or vice versa"
    else:
        assert all(t.applied), f"{case.id}: scaling off with skip_nonfinite=False must apply every step"


def loss_residuals(case: Case, side: Trajectory) -> dict[str, np.ndarray]:
    """Per clean step: the reported loss, the FP64 loss of the pre-step FP32 state on the step's batch, the bound.

    Returns arrays over the clean (non-overflow) steps: ``step``, ``loss``, ``fp64``,
    ``resid`` (= loss - fp64), ``bound`` (= eps * S + K_LOSS32 * eps32 * max(1, |fp64|)).
    """
    clean = np.flatnonzero(~np.asarray(side.overflow))
    b = case.batches()
    assert np.all(b.f[clean] == 1.0), f"{case.id}: a clean step with a blow-up factor"
    pre = side.pre_step_states()
    fp64, sens = harness.fp64_losses(case.kind, side.shapes, pre[clean], b.x[clean], b.y[clean], b.w[clean])
    loss = np.asarray(side.losses, np.float64)[clean]
    bound = EPS[case.compute] * sens + K_LOSS32 * EPS["float32"] * np.maximum(1.0, np.abs(fp64))
    return {"step": clean, "loss": loss, "fp64": fp64, "resid": loss - fp64, "bound": bound}


def path_length(side: Trajectory) -> np.ndarray:
    """``P_t`` after each step: the summed norms of the FP32 state's per-step changes."""
    states = np.stack([side.init_state] + list(side.states)).astype(np.float64)
    return np.cumsum(np.linalg.norm(np.diff(states, axis=0), axis=1))


def assert_parity(case: Case, t: Trajectory, k: Trajectory) -> dict[str, Any]:
    """Every parity guarantee for one case; returns the observed numbers (eps of the compute dtype)."""
    assert_decisions_equal(case, t, k)
    assert_same_layout(case, t, k)
    observed: dict[str, Any] = {"case": case.id}
    observed.update(assert_losses(case, t, k))
    observed.update(assert_states(case, t, k))
    observed.update(assert_slots(case, t, k))
    observed.update(assert_storage(case, t, k))
    return observed


def assert_same_layout(case: Case, t: Trajectory, k: Trajectory) -> None:
    """Both record every step, and hold the same number of FP32 arrays of the same shapes."""
    for side in (t, k):
        assert len(side.states) == len(side.losses) == case.steps, (len(side.states), case.steps)
        assert side.init_state is not None
        assert len(side.low_snapshots) == case.steps // case.snapshot_every
    pairs(t.fp32, k.fp32, f"{case.id}: FP32 state arrays")
    assert t.shapes == k.shapes, (t.shapes, k.shapes)


def assert_losses(case: Case, t: Trajectory, k: Trajectory) -> dict[str, float]:
    """Non-finite on the injected inf steps in both; on every applied step, the loss each
    framework reports is the loss of the weights it held, on the right batch, up to rounding."""
    eps = EPS[case.compute]
    observed: dict[str, float] = {}
    tl, kl = np.asarray(t.losses), np.asarray(k.losses)
    for s in case.inf_steps:
        if s < case.steps and case.recipe_obj.scaler.enabled:
            assert not np.isfinite(tl[s]) and not np.isfinite(kl[s]), f"{case.id}: step {s} loss should be inf"
    clean = ~np.asarray(t.overflow)
    assert np.all(np.isfinite(tl[clean])) and np.all(np.isfinite(kl[clean])), f"{case.id}: non-finite clean loss"
    for name, side in (("lightning", t), ("keras", k)):
        r = loss_residuals(case, side)
        ratio = np.abs(r["resid"]) / r["bound"]
        worst = int(np.argmax(ratio))
        observed[f"loss_{name}"] = float(np.max(np.abs(r["resid"]) / np.maximum(1.0, np.abs(r["fp64"])))) / eps
        observed[f"loss_{name}_of_bound"] = float(ratio[worst])
        assert ratio[worst] <= 1.0, (
            f"{case.id}: {name}'s loss at step {int(r['step'][worst])} is {r['loss'][worst]:.7g}, the FP64 loss "
            f"of its weights on that batch {r['fp64'][worst]:.7g}: residual {abs(r['resid'][worst]):.3g} > "
            f"bound {r['bound'][worst]:.3g} (eps * sensitivity + FP32 part)")
    dl = np.abs(tl[clean] - kl[clean]) / np.maximum(1.0, np.abs(tl[clean]))
    observed["loss_cross"] = float(dl.max()) / eps  # reported, not bounded: see the two checks above
    return observed


def assert_states(case: Case, t: Trajectory, k: Trajectory) -> dict[str, Any]:
    """FP32 state every snapshot_every steps: the difference against the path travelled."""
    eps = EPS[case.compute]
    bound = state_factor(case) * eps
    p = np.minimum(path_length(t), path_length(k))
    observed: dict[str, Any] = {"state": []}
    for step in range(case.snapshot_every - 1, case.steps, case.snapshot_every):
        a, b = t.states[step], k.states[step]
        assert np.all(np.isfinite(a)) and np.all(np.isfinite(b)), f"{case.id}: non-finite FP32 state"
        dw = float(np.linalg.norm(a.astype(np.float64) - b))
        observed["state"].append(dw / p[step] / eps)
        assert dw <= bound * p[step], (
            f"{case.id}: FP32 state at step {step + 1} differs by {dw:.3g} (L2) = {dw / p[step] / eps:.3g} eps "
            f"of the path length {p[step]:.3g}; bound {state_factor(case)} eps")
    for name, side in (("lightning", t), ("keras", k)):
        final = np.concatenate([a.ravel() for a in side.fp32])
        np.testing.assert_array_equal(final, side.states[-1], err_msg=f"{case.id}: {name} final != last state")
    return observed


def assert_slots(case: Case, t: Trajectory, k: Trajectory) -> dict[str, float]:
    """Optimizer slots (FP32 in both) per parameter; Keras' SGD momentum is -lr times torch's buffer."""
    eps = EPS[case.compute]
    assert set(t.slot_dtypes) == set(k.slot_dtypes) == {"float32"}, (t.slot_dtypes, k.slot_dtypes)
    n_slots = 1 if case.optimizer == "sgd" else 2
    worst = 0.0
    for i, (sa, sk) in enumerate(pairs(t.slots, k.slots, f"{case.id}: parameters with slots")):
        assert len(sa) == len(sk) == n_slots, f"{case.id}: parameter {i} has {len(sa)} / {len(sk)} slots"
        for j, (x, y) in enumerate(zip(sa, sk)):
            y = -y / SGD["lr"] if case.optimizer == "sgd" else y
            rel = _rel_l2(x, y)
            worst = max(worst, rel)
            assert rel <= slot_factor(case) * eps, (
                f"{case.id}: optimizer slot {j} of parameter {i} differs by {rel:.3g} (rel L2) = {rel / eps:.3g} "
                f"eps; bound {slot_factor(case)} eps")
    return {"slots": worst / eps}


def assert_storage(case: Case, t: Trajectory, k: Trajectory) -> dict[str, float]:
    """The same dtype per parameter; low copies are the rounded masters, and agree as their masters do."""
    eps = EPS[case.compute]
    observed: dict[str, float] = {}
    assert t.low_dtypes == k.low_dtypes, (t.low_dtypes, k.low_dtypes)
    recipe = case.recipe_obj
    if recipe.master.master_weights:
        low = recipe.master.param_dtype
        assert low in t.low_dtypes and "float32" in t.low_dtypes  # low layers + FP32-kept (norm/head)
        for side in (t, k):
            pairs(side.fp32, side.low_dtypes, f"{case.id}: masters vs copy dtypes")
            for (master, copy), dtype in zip(pairs(side.fp32, side.low, f"{case.id}: masters vs copies"),
                                             side.low_dtypes):
                np.testing.assert_array_equal(copy, _round_to(master, dtype))
        for step_i, (la, lk) in enumerate(pairs(t.low_snapshots + [np.concatenate([a.ravel() for a in t.low])],
                                                k.low_snapshots + [np.concatenate([a.ravel() for a in k.low])],
                                                "copy snapshots")):
            step = (step_i + 1) * case.snapshot_every - 1 if step_i < len(t.low_snapshots) else case.steps - 1
            ma, mk = t.states[step].astype(np.float64), k.states[step].astype(np.float64)
            allowed = np.abs(ma - mk) + EPS[low] * np.maximum(np.abs(ma), np.abs(mk)) + TINY[low]
            assert np.all(np.abs(la.astype(np.float64) - lk) <= allowed), \
                f"{case.id}: low-precision copies at step {step + 1} differ by more than their masters + 1 rounding"
        la, lk = np.concatenate([a.ravel() for a in t.low]), np.concatenate([a.ravel() for a in k.low])
        m_l2, l_l2 = _rel_l2(t.states[-1], k.states[-1]), _rel_l2(la, lk)
        observed.update(master_l2=m_l2 / eps, low_l2=l_l2 / eps)
        # The FP32 masters agree more tightly than the copies rounded from them (in L2:
        # rounding adds up to half an ulp per element on each side; the worst single
        # element can go either way, as two close masters may round to the same value).
        assert m_l2 < l_l2, f"{case.id}: masters {m_l2:.3g} vs low {l_l2:.3g} (rel L2)"
    else:
        assert set(t.low_dtypes) == {"float32"}
        for side in (t, k):
            for master, copy in pairs(side.fp32, side.low, f"{case.id}: FP32 params vs model params"):
                np.testing.assert_array_equal(master, copy)
    return observed
