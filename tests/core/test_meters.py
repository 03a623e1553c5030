"""The meter rules against brute-force rounding in the real formats."""

import numpy as np
import pytest

from mp_callbacks.diagnostics import (
    DivergenceError,
    DivergenceGuard,
    FallbackTracker,
    grad_underflow_fraction,
    half_ulp,
    underflow_threshold,
    update_swamped_fraction,
)

ml_dtypes = pytest.importorskip("ml_dtypes")  # ships with keras/tensorflow: a real bfloat16


def test_swamping_is_one_for_bf16_weights_and_zero_for_fp32():
    rng = np.random.default_rng(0)
    w = 1.0 + rng.uniform(-0.05, 0.05, 10_000)
    d = np.full_like(w, 1e-5)  # lr * grad = 1e-5
    assert update_swamped_fraction([w], [d], "bfloat16") == 1.0
    assert update_swamped_fraction([w], [d], "float32") == 0.0


@pytest.mark.parametrize("storage,np_type", [("bfloat16", "bfloat16"), ("float16", np.float16),
                                             ("float32", np.float32)])
def test_swamping_rule_matches_real_rounding(storage, np_type):
    """|d| < ulp/2 exactly when w + d rounds back to w (ties excluded)."""
    dtype = np.dtype(getattr(ml_dtypes, np_type) if isinstance(np_type, str) else np_type)
    rng = np.random.default_rng(1)
    w = (rng.uniform(0.1, 100, 5000) * rng.choice([-1, 1], 5000)).astype(dtype).astype(np.float64)
    d = w * 10.0 ** rng.uniform(-9, -1, 5000)
    h = half_ulp(w, storage)
    lost_rule = np.abs(d) < h
    lost_real = (w + d).astype(dtype).astype(np.float64) == w
    near_tie = np.isclose(np.abs(d), h, rtol=1e-6)
    assert np.array_equal(lost_rule[~near_tie], lost_real[~near_tie])
    assert 0 < lost_rule.mean() < 1


@pytest.mark.parametrize("compute,np_type", [("float16", np.float16), ("bfloat16", "bfloat16")])
def test_underflow_rule_matches_real_rounding_and_rises_as_scale_drops(compute, np_type):
    dtype = np.dtype(getattr(ml_dtypes, np_type) if isinstance(np_type, str) else np_type)
    rng = np.random.default_rng(2)
    g = 10.0 ** rng.uniform(-45, -2, 20_000)
    fracs = []
    for scale in (2.0**16, 2.0**8, 1.0, 2.0**-8):
        limit = underflow_threshold(compute, scale)
        kept = g[~np.isclose(g, limit, rtol=1e-6, atol=0)]  # drop exact ties
        rule = grad_underflow_fraction([kept], compute, scale)
        real = np.mean((kept * scale).astype(dtype) == 0)
        assert rule == real
        fracs.append(rule)
    assert fracs == sorted(fracs) and fracs[-1] > fracs[0]


def test_divergence_guard_names_scale_module_and_checklist():
    guard = DivergenceGuard(patience=3)
    guard.observe(1, 1.0, 1.0, True)
    guard.observe(2, 1.0, 1.0, False)  # a clean step resets the streak
    guard.observe(3, 1.0, 1.0, True)
    guard.observe(4, 1.0, 1.0, True)
    with pytest.raises(DivergenceError, match=r"3 consecutive overflows .*scale=1.*step 5.*'net.2'.*learning rate"):
        guard.observe(5, 1.0, 1.0, True, module="net.2")
    with pytest.raises(ValueError, match="patience=0"):
        DivergenceGuard(0)


def test_fallback_tracker():
    t = FallbackTracker(threshold=2)
    assert [t.blame_module("a"), t.blame_module("b"), t.blame_module("a"), t.blame_module("a")] == [
        False, False, True, False]
    assert t.moved == ["a"]
    u = FallbackTracker()
    u.load_state_dict(t.state_dict())
    assert u.state_dict() == t.state_dict()


def test_sample_stride_rule():
    from mp_callbacks.diagnostics import METER_SAMPLES, check_samples, sample_stride, sampled

    assert sample_stride(METER_SAMPLES) == 1 and sample_stride(10**9, None) == 1
    for numel in [4097, 10_000, 2**20, 3 * 2**20 + 7, 10**8]:
        for samples in [1, 100, 4096]:
            s = sample_stride(numel, samples)
            assert s % 2 == 1 and len(range(0, numel, s)) <= samples
    # An odd stride walks across the columns of a power-of-two-wide matrix instead of a few of them.
    cols = {i % 1024 for i in range(0, 1024 * 1024, sample_stride(1024 * 1024))}
    assert len(cols) > 1000
    np.testing.assert_array_equal(sampled(np.arange(20).reshape(4, 5), 5), [0, 5, 10, 15])
    with pytest.raises(ValueError, match="meter_samples"):
        check_samples(0)


def test_sampled_references_read_the_same_elements():
    from mp_callbacks.diagnostics import grad_underflow_fraction, sampled, update_swamped_fraction

    rng = np.random.default_rng(1)
    g = (rng.standard_normal(50_000) * np.exp2(rng.uniform(-40, 0, 50_000))).astype(np.float32)
    w = rng.standard_normal(50_000).astype(np.float32)
    d = (w * np.exp2(rng.uniform(-30, 0, 50_000))).astype(np.float32)
    assert grad_underflow_fraction([g], "float16", 1.0, samples=999) == \
        grad_underflow_fraction([sampled(g, 999)], "float16", 1.0)
    assert update_swamped_fraction([w], [d], "bfloat16", samples=999) == \
        update_swamped_fraction([sampled(w, 999)], [sampled(d, 999)], "bfloat16")
    # A 999-element sample estimates the full share closely on data without structure.
    full, part = (update_swamped_fraction([w], [d], "bfloat16", samples=s) for s in (None, 999))
    assert abs(full - part) < 0.05
