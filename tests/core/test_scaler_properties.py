"""Properties of the transition, checked by Hypothesis over configs and overflow sequences."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mp_callbacks import DynamicLossScaler, ScalerConfig, StateDictError

# Exponents near the top are drawn often, so that growth candidates overflow float32 (2**126 * 4 = inf).
powers = st.one_of(st.integers(min_value=-126, max_value=127), st.integers(min_value=124, max_value=127)).map(
    lambda e: 2.0**e)


@st.composite
def configs(draw):
    lo, hi = sorted((draw(powers), draw(powers)))
    init = 2.0 ** draw(st.integers(int(math.log2(lo)), int(math.log2(hi))))
    return ScalerConfig(
        init_scale=init,
        min_scale=lo,
        max_scale=hi,
        growth_factor=draw(st.sampled_from([2.0, 4.0, 1.5, 3.0])),
        backoff_factor=draw(st.sampled_from([0.5, 0.25, 0.7])),
        growth_interval=draw(st.integers(1, 6)),
        hysteresis=draw(st.integers(1, 4)),
        consecutive_hysteresis=draw(st.booleans()),
    )


sequences = st.lists(st.booleans(), min_size=1, max_size=150)


@settings(max_examples=150, deadline=None)
@given(configs(), sequences)
def test_scale_stays_in_bounds_finite_and_positive(config, flags):
    scaler = DynamicLossScaler(config)
    for f in flags:
        applied = scaler.update(f)
        assert applied is (not f)
        s = scaler.scale
        assert math.isfinite(s) and s > 0
        assert np.float32(config.min_scale) <= s <= np.float32(config.max_scale)
    assert scaler.steps == len(flags)
    assert scaler.overflows == scaler.skipped == sum(flags)


def expected_growth(scale: float, config: ScalerConfig) -> np.float32:
    """The documented growth rule, evaluated independently in float32: the candidate
    ``scale * growth_factor`` is taken (capped at ``max_scale``) only if it is finite;
    otherwise the scale stays where it is."""
    with np.errstate(over="ignore"):
        candidate = np.float32(scale) * np.float32(config.growth_factor)
    if not np.isfinite(candidate):
        return np.float32(scale)
    return min(candidate, np.float32(config.max_scale))


@settings(max_examples=150, deadline=None)
@given(configs(), sequences)
def test_growth_only_after_growth_interval_clean_steps(config, flags):
    scaler = DynamicLossScaler(config)
    clean_run = 0  # clean steps since the last overflow or growth opportunity
    for f in flags:
        before, growths_before = scaler.scale, scaler.growths
        scaler.update(f)
        clean_run = 0 if f else clean_run + 1
        if scaler.scale > before:
            assert not f and clean_run == config.growth_interval
        if not f and clean_run == config.growth_interval:
            clean_run = 0
            expected = expected_growth(before, config)
            assert scaler.scale == expected
            # a growth is counted exactly when the scale moved
            assert scaler.growths == growths_before + (1 if expected != np.float32(before) else 0)
        else:
            assert scaler.growths == growths_before


@pytest.mark.parametrize("factor, init, max_scale, want, grew", [
    # 2**126 * 4 = 2**128 is inf in float32: not finite, so the scale stays (the cap is not applied to inf)
    (4.0, 2.0**126, 2.0**127, 2.0**126, False),
    # 2**126 * 2 = 2**127 is finite and within the cap
    (2.0, 2.0**126, 2.0**127, 2.0**127, True),
    # 2**125 * 4 = 2**127 is finite: capped at max_scale = 2**126
    (4.0, 2.0**125, 2.0**126, 2.0**126, True),
    # already at the cap: the capped candidate equals the scale, which is no growth
    (2.0, 2.0**127, 2.0**127, 2.0**127, False),
])
def test_growth_candidate_must_be_finite_before_the_cap(factor, init, max_scale, want, grew):
    config = ScalerConfig(init_scale=init, min_scale=1.0, max_scale=max_scale, growth_factor=factor,
                          growth_interval=1)
    scaler = DynamicLossScaler(config)
    assert scaler.update(False) is True
    assert scaler.scale == want == expected_growth(init, config)
    assert scaler.growths == int(grew)
    assert math.isfinite(scaler.scale)


@settings(max_examples=150, deadline=None)
@given(configs(), sequences)
def test_hysteresis_honoured(config, flags):
    """A backoff needs ``hysteresis`` overflows since the last refill."""
    scaler = DynamicLossScaler(config)
    since_refill = 0
    clean_run = 0
    for f in flags:
        before = scaler.scale
        scaler.update(f)
        if f:
            since_refill += 1
            clean_run = 0
            backed_off = scaler.scale < before
            expected = since_refill >= config.hysteresis and before > np.float32(config.min_scale)
            assert backed_off == expected
        else:
            clean_run += 1
            if config.consecutive_hysteresis or clean_run == config.growth_interval:
                since_refill = 0
            if clean_run == config.growth_interval:
                clean_run = 0


@settings(max_examples=100, deadline=None)
@given(configs(), sequences, sequences)
def test_state_dict_round_trip_continues_identically(config, prefix, suffix):
    a = DynamicLossScaler(config)
    for f in prefix:
        a.update(f)
    b = DynamicLossScaler(config)
    b.load_state_dict(a.state_dict())
    for f in suffix:
        assert a.update(f) == b.update(f)
        assert a.state_dict() == b.state_dict()


def test_disabled_scaler_skips_nonfinite_steps_by_default_and_counts_overflows():
    s = DynamicLossScaler(ScalerConfig(enabled=False))
    assert [s.update(f) for f in (True, False, True)] == [False, True, False]
    assert (s.scale, s.overflows, s.skipped, s.growths, s.floor_hits) == (1.0, 2, 2, 0, 0)


def test_disabled_scaler_without_skip_nonfinite_never_skips_and_counts_overflows():
    s = DynamicLossScaler(ScalerConfig(enabled=False, skip_nonfinite=False))
    assert [s.update(f) for f in (True, False, True)] == [True, True, True]
    assert (s.scale, s.overflows, s.skipped) == (1.0, 2, 0)


def test_static_scaler_keeps_scale_but_skips():
    s = DynamicLossScaler(ScalerConfig(init_scale=128.0, dynamic=False, growth_interval=1))
    assert [s.update(f) for f in (True, False, False)] == [False, True, True]
    assert (s.scale, s.skipped) == (128.0, 1)


def test_floor_policies():
    from mp_callbacks import ScaleFloorError, ScaleFloorWarning

    warn = DynamicLossScaler(ScalerConfig(init_scale=2.0, min_scale=1.0, on_min_scale="warn"))
    warn.update(True)  # 2 -> 1, not yet a floor hit
    with pytest.warns(ScaleFloorWarning, match="step 2.*scale=1"):
        warn.update(True)
    assert warn.floor_hits == 1 and warn.scale == 1.0
    clamp = DynamicLossScaler(ScalerConfig(init_scale=1.0, min_scale=1.0))
    clamp.update(True)
    assert clamp.floor_hits == 1 and clamp.scale == 1.0
    raising = DynamicLossScaler(ScalerConfig(init_scale=1.0, min_scale=1.0, on_min_scale="raise"))
    with pytest.raises(ScaleFloorError, match="lower the learning rate"):
        raising.update(True)


def test_state_dict_errors_are_clear():
    s = DynamicLossScaler("torch")
    sd = s.state_dict()
    with pytest.raises(StateDictError, match="schema_version=99"):
        s.load_state_dict({**sd, "schema_version": 99})
    with pytest.raises(StateDictError, match="growth_interval: saved 2000 vs current 10"):
        DynamicLossScaler(ScalerConfig(growth_interval=10)).load_state_dict(sd)
    with pytest.raises(StateDictError, match="missing"):
        s.load_state_dict({**sd, "state": {"scale": 1.0}})
    with pytest.raises(StateDictError, match="scale=nan"):
        s.load_state_dict({**sd, "state": {**sd["state"], "scale": float("nan")}})
    with pytest.raises(StateDictError, match="must be a dict"):
        s.load_state_dict([1, 2])
    assert s.state_dict() == sd  # nothing changed by the failed loads
