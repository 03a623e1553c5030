"""Inputs shared by the FP8 backend tests: each backend's ops and transition against the NumPy reference.

:func:`op_cases` gives the arguments of the five :class:`~mp_callbacks.fp8.scaling.FP8ArrayOps`
(and the batched ``where``) with their NumPy results; :func:`step_batched` steps a batch of
states with any backend.  The adapters' tests (``tests/lightning/test_fp8_ops.py``,
``tests/keras/test_fp8_ops.py``) compare bit for bit.
"""

from __future__ import annotations

import numpy as np

from mp_callbacks.fp8 import FLOAT32_MAX, NUMPY_FP8_OPS, FP8State, initial_fp8_state, next_fp8_state

f32 = np.float32


def bits(a) -> np.ndarray:
    """Float32 (or int32/bool) values as integers: exact comparison, -0.0, inf and NaN payloads included."""
    a = np.ascontiguousarray(np.asarray(a))
    return a.view(np.int32) if a.dtype == np.float32 else a.astype(np.int64)


def same(a, b) -> bool:
    """Same dtype kind, shape and bits (NaNs only need to be NaN on both sides)."""
    a, b = np.asarray(a), np.asarray(b)
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.dtype == np.float32:
        nan = np.isnan(a)
        return np.array_equal(nan, np.isnan(b)) and np.array_equal(bits(a[~nan]), bits(b[~nan]))
    return np.array_equal(a, b)


def divide_cases() -> tuple[np.ndarray, np.ndarray]:
    """Numerators and denominators: zeros (x/0, 0/0), overflow, subnormal results, inf, NaN, random."""
    rng = np.random.default_rng(7)
    a = [1.0, 0.0, 448.0, 57344.0, 448.0, 1.0, 448.0, np.inf, 1.0, 3.0, -2.0, np.nan, 448.0]
    b = [0.0, 0.0, 1e-38, 2.0**-149, FLOAT32_MAX, FLOAT32_MAX, np.inf, 2.0, 3.0, 7.0, 0.0, 1.0, 3.3e-3]
    ra = (rng.uniform(-1, 1, 200) * np.exp2(rng.uniform(-30, 30, 200)))
    rb = (rng.uniform(0.1, 1, 200) * np.exp2(rng.uniform(-140, 120, 200)))
    return np.asarray(a + list(ra), f32), np.asarray(b + list(rb), f32)


def history_cases() -> np.ndarray:
    """A batch of 6 histories of length 5 (zeros, repeats, float32 max, subnormals)."""
    rng = np.random.default_rng(8)
    h = (rng.uniform(0, 1, (6, 5)) * np.exp2(rng.uniform(-140, 120, (6, 5)))).astype(f32)
    h[0] = 0.0
    h[1, 2:] = h[1, 1]
    h[2, 3] = FLOAT32_MAX
    h[3, 0] = 2.0**-149
    return h


def op_cases():
    """``[(name, args, expected)]`` for each FP8 op, single and batched, with NumPy's results."""
    ref = NUMPY_FP8_OPS
    num, den = divide_cases()
    h = history_cases()
    values = np.asarray([3.5, 0.0, FLOAT32_MAX, 2.0**-149, 1.0, 7.0], f32)
    cond = np.asarray([True, False, True, False, False, True])
    return [
        ("divide", (num, den), ref.divide(num, den)),
        ("divide", (f32(448.0), f32(0.0)), ref.divide(f32(448.0), f32(0.0))),
        ("reduce_max", (h[2],), ref.reduce_max(h[2])),
        ("reduce_max", (h,), ref.reduce_max(h)),
        ("roll_left", (h[1],), ref.roll_left(h[1])),
        ("roll_left", (h,), ref.roll_left(h)),
        ("set_first", (h[3], f32(9.0)), ref.set_first(h[3], f32(9.0))),
        ("set_first", (h, f32(0.0)), ref.set_first(h, f32(0.0))),
        ("set_first", (h, values), ref.set_first(h, values)),
        ("zeros", (5,), ref.zeros(5)),
        ("where", (cond, h, h * f32(0.5)), ref.where(cond, h, h * f32(0.5))),
        ("where", (cond, values, f32(1.0)), ref.where(cond, values, f32(1.0))),
    ]


def batched_initial(config, batch: int, ops=NUMPY_FP8_OPS, to_backend=None) -> FP8State:
    """``batch`` initial states stacked (history ``(batch, L)``, scalars ``(batch,)``)."""
    one = initial_fp8_state(config)
    state = FP8State(np.tile(one.amax_history, (batch, 1)), np.full(batch, one.scale, f32),
                     np.full(batch, one.scale_inv, f32), np.zeros(batch, np.int32), np.zeros(batch, np.int32))
    return state if to_backend is None else FP8State(*(to_backend(x) for x in state))


def step_batched(config, amaxes: np.ndarray, ops, to_backend, to_numpy, step=None):
    """Step ``amaxes`` (``(batch, steps)``) with ``ops`` and with NumPy; yield both states after each step.

    ``step(config, state, amax)`` replaces ``next_fp8_state(config, state, amax, ops)`` (e.g. a
    compiled function).
    """
    batch, steps = amaxes.shape
    ref = batched_initial(config, batch)
    got = batched_initial(config, batch, to_backend=to_backend)
    for t in range(steps):
        ref, ref_ok = next_fp8_state(config, ref, amaxes[:, t])
        if step is None:
            got, ok = next_fp8_state(config, got, to_backend(amaxes[:, t]), ops)
        else:
            got, ok = step(config, got, to_backend(amaxes[:, t]))
        yield t, ref, ref_ok, FP8State(*(np.asarray(to_numpy(x)) for x in got)), np.asarray(to_numpy(ok))
