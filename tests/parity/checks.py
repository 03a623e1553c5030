"""What "parity" means, as assertions with stated tolerances (see README.md for the reasoning).

Exactly equal (``==`` on every step): the scale each step's loss was multiplied
by, the scale after the step, the overflow flag, the applied/skipped decision,
the counters (steps, overflows, skipped, growths) and the optimizer's own step
count.  Both also equal the core's NumPy reference evaluated on the same flags.

Within tolerance, in units of ``eps`` = the machine epsilon of the recipe's
*compute* dtype (float32 2**-23, float16 2**-10, bfloat16 2**-7); ``K`` is 16,
except 128 for AdamW under ``32-true`` (Adam divides every coordinate's update by
that coordinate's RMS gradient, which magnifies float32 accumulation-order noise
in small-gradient coordinates; in float16/bfloat16 the same noise is far below
one rounding step of the compute dtype):

* per-step loss on every applied step: ``|dl| <= K eps max(1, |l|)``;
* FP32 state (masters, or the FP32 parameters), every 25 steps and at the end:
  ``max|dw| <= K eps max(1, max|w|)`` and ``||dw|| / ||w|| <= K eps``;
* optimizer slots (momentum; Adam m and v, all FP32): ``||ds|| / ||s|| <= 8 K eps``
  per parameter (a slot is a running sum of recent gradients: it carries the
  step's gradient difference without the averaging over steps that the weights get);
* ``*-master`` low-precision copies: ``max|dw| <= K eps max(1, max|w|) + eps_storage``
  (the FP32 bound plus one rounding), and the FP32 masters agree more tightly
  than the copies in L2.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mp_callbacks.scaler import initial_state, next_state

from .runs import SGD, Case, Trajectory

EPS = {"float32": 2.0**-23, "float16": 2.0**-10, "bfloat16": 2.0**-7}
K = 16
K_ADAMW_FP32 = 128
SLOT_FACTOR = 8


def k_factor(case: Case) -> int:
    """The tolerance factor K of ``case`` (see the module docstring)."""
    return K_ADAMW_FP32 if (case.optimizer == "adamw" and case.compute == "float32") else K


def _first_difference(a: list, b: list) -> str:
    if len(a) != len(b):
        return f"lengths {len(a)} != {len(b)}"
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return f"step {i}: lightning {x!r} != keras {y!r}"
    return "equal"


def _rel_l2(a: np.ndarray, b: np.ndarray) -> float:
    norm = float(np.linalg.norm(a.astype(np.float64)))
    return float(np.linalg.norm(a.astype(np.float64) - b.astype(np.float64))) / max(norm, 1e-30)


def _max_rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a.astype(np.float64) - b.astype(np.float64)))) / max(1.0, float(np.max(np.abs(a))))


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
        assert t.applied == [not o for o in t.overflow], f"{case.id}: a skip without overflow or vice versa"
    else:
        assert all(t.applied) and set(t.scale) == {1.0}, f"{case.id}: scaling off must apply every step at scale 1"


def assert_parity(case: Case, t: Trajectory, k: Trajectory) -> dict[str, Any]:
    """Every parity guarantee for one case; returns the observed numbers (in eps units)."""
    assert_decisions_equal(case, t, k)
    eps = EPS[case.compute]
    bound = k_factor(case) * eps
    slot_bound = SLOT_FACTOR * bound
    observed: dict[str, Any] = {"case": case.id}

    # Losses: non-finite on the injected inf steps in both; within bound on every applied step.
    tl, kl = np.asarray(t.losses), np.asarray(k.losses)
    for s in case.inf_steps:
        if s < case.steps and case.recipe_obj.scaler.enabled:
            assert not np.isfinite(tl[s]) and not np.isfinite(kl[s]), f"{case.id}: step {s} loss should be inf"
    clean = ~np.asarray(t.overflow)
    assert np.all(np.isfinite(tl[clean])) and np.all(np.isfinite(kl[clean])), f"{case.id}: non-finite clean loss"
    loss_err = np.abs(tl[clean] - kl[clean]) / np.maximum(1.0, np.abs(tl[clean]))
    observed["loss"] = float(loss_err.max()) / eps
    assert loss_err.max() <= bound, (
        f"{case.id}: loss differs by {loss_err.max():.3g} (relative) at step "
        f"{int(np.flatnonzero(clean)[np.argmax(loss_err)])}; bound {bound:.3g}")

    # FP32 state every snapshot_every steps: the divergence never exceeds the bound.
    assert len(t.snapshots) == len(k.snapshots) == case.steps // case.snapshot_every
    observed["state_max"], observed["state_l2"] = [], []
    for i, (a, b) in enumerate(zip(t.snapshots, k.snapshots)):
        m, l2 = _max_rel(a, b), _rel_l2(a, b)
        observed["state_max"].append(m / eps)
        observed["state_l2"].append(l2 / eps)
        step = (i + 1) * case.snapshot_every
        assert m <= bound and l2 <= bound, (
            f"{case.id}: FP32 state at step {step} differs by max {m:.3g} / L2 {l2:.3g}; bound {bound:.3g}")
    fa, fk = np.concatenate([a.ravel() for a in t.fp32]), np.concatenate([a.ravel() for a in k.fp32])
    assert np.all(np.isfinite(fa)) and np.all(np.isfinite(fk))
    assert _max_rel(fa, fk) <= bound and _rel_l2(fa, fk) <= bound, f"{case.id}: final FP32 state"

    # Optimizer slots (FP32 in both); Keras' SGD momentum is -lr times torch's buffer.
    assert set(t.slot_dtypes) == set(k.slot_dtypes) == {"float32"}, (t.slot_dtypes, k.slot_dtypes)
    worst = 0.0
    for sa, sk in zip(t.slots, k.slots):
        assert len(sa) == len(sk) == (1 if case.optimizer == "sgd" else 2)
        for x, y in zip(sa, sk):
            y = -y / SGD["lr"] if case.optimizer == "sgd" else y
            worst = max(worst, _rel_l2(x, y))
    observed["slots"] = worst / eps
    assert worst <= slot_bound, f"{case.id}: optimizer slots differ by {worst:.3g} (rel L2); bound {slot_bound:.3g}"

    # Storage: the same dtype per parameter; low copies are the rounded masters.
    assert t.low_dtypes == k.low_dtypes, (t.low_dtypes, k.low_dtypes)
    recipe = case.recipe_obj
    if recipe.master.master_weights:
        low = recipe.master.param_dtype
        assert low in t.low_dtypes and "float32" in t.low_dtypes  # low layers + FP32-kept (norm/head)
        for side in (t, k):
            for master, copy, dtype in zip(side.fp32, side.low, side.low_dtypes):
                np.testing.assert_array_equal(copy, _round_to(master, dtype))
        la, lk = np.concatenate([a.ravel() for a in t.low]), np.concatenate([a.ravel() for a in k.low])
        m_max, l_max = _max_rel(fa, fk), _max_rel(la, lk)
        m_l2, l_l2 = _rel_l2(fa, fk), _rel_l2(la, lk)
        observed.update(master_max=m_max / eps, low_max=l_max / eps, master_l2=m_l2 / eps, low_l2=l_l2 / eps)
        # The FP32 masters agree more tightly than the copies rounded from them (in L2:
        # rounding adds up to half an ulp per element on each side; the worst single
        # element can go either way, as two close masters may round to the same value).
        assert m_l2 < l_l2, f"{case.id}: masters {m_max:.3g}/{m_l2:.3g} vs low {l_max:.3g}/{l_l2:.3g}"
        assert l_max <= bound + EPS[low], f"{case.id}: low-precision copies differ by {l_max:.3g}"
        for a, b in zip(t.low_snapshots, k.low_snapshots):
            assert _max_rel(a, b) <= bound + EPS[low]
    else:
        assert set(t.low_dtypes) == {"float32"}
        for side in (t, k):
            for master, copy in zip(side.fp32, side.low):
                np.testing.assert_array_equal(master, copy)
    return observed
