"""The core's rule of which scaler fields and divergence streaks a step can move (``moving_fields``,
``fixed_scale``, ``moving_streaks``): what the adapters leave unread and unwritten.

Checked against the full transition: over random configs and overflow sequences, ``next_state``
given None for every field outside ``moving_fields`` returns those Nones untouched and the same
values for the others as from the full state; ``next_divergence_state`` with a known scale at or
above ``scale_below`` and no overflow streak gives the same streaks and stops as with the streak read.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mp_callbacks import ScalerConfig
from mp_callbacks.diagnostics import DivergenceRule, DivergenceState, moving_streaks, next_divergence_state
from mp_callbacks.loss_scale import STATE_FIELDS, fixed_scale, initial_state, moving_fields, next_state

CONFIGS = [ScalerConfig(enabled=False), ScalerConfig(enabled=False, skip_nonfinite=False),
           ScalerConfig.preset("torch").replace(dynamic=False), ScalerConfig.preset("torch"),
           ScalerConfig.preset("keras"), ScalerConfig.preset("megatron")]


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(CONFIGS), st.lists(st.booleans(), min_size=1, max_size=40))
def test_next_state_neither_reads_nor_moves_the_fields_outside_moving_fields(config, flags):
    moving = moving_fields(config)
    full = initial_state(config)
    for flag in flags:
        partial = full._replace(**{f: None for f in STATE_FIELDS if f not in moving})
        new_partial, applied_partial = next_state(config, partial, np.bool_(flag))
        new_full, applied_full = next_state(config, full, np.bool_(flag))
        assert bool(applied_partial) == bool(applied_full)
        for field in STATE_FIELDS:
            if field in moving:
                assert getattr(new_partial, field) == getattr(new_full, field), field
            else:
                assert getattr(new_partial, field) is None
                assert getattr(new_full, field) is getattr(full, field)  # the full transition keeps it too
        full = new_full


def test_which_fields_move_and_the_fixed_scale():
    assert moving_fields(ScalerConfig(enabled=False)) == ("steps", "overflows", "skipped")
    assert moving_fields(ScalerConfig(enabled=False, skip_nonfinite=False)) == ("steps", "overflows")
    assert moving_fields(ScalerConfig.preset("torch").replace(dynamic=False)) == ("steps", "overflows", "skipped")
    assert moving_fields(ScalerConfig.preset("keras")) == STATE_FIELDS
    assert fixed_scale(ScalerConfig(enabled=False)) == 1.0
    assert fixed_scale(ScalerConfig.preset("keras")) is None
    assert fixed_scale(ScalerConfig.preset("torch").replace(dynamic=False)) is None  # a checkpoint may set it


@pytest.mark.parametrize("scale_below", [1.0, 0.5, 2.0])
@settings(max_examples=40, deadline=None)
@given(steps=st.lists(st.tuples(st.booleans(), st.booleans()), min_size=1, max_size=30))
def test_a_known_scale_at_or_above_scale_below_holds_the_overflow_streak_at_zero(scale_below, steps):
    rule = DivergenceRule(nonfinite_losses=3, overflows_below=2, scale_below=scale_below)
    moving = moving_streaks(rule, 1.0)
    assert moving == (("loss_streak",) if scale_below <= 1.0 else DivergenceState._fields)
    assert moving_streaks(rule, np.float32(1.0)) == DivergenceState._fields  # not a known Python number
    full = partial = DivergenceState(np.int32(0), np.int32(0))
    for overflow, finite in steps:
        full, stop_full = next_divergence_state(rule, full, overflow, finite, np.float32(1.0))
        if "overflow_streak" not in moving:
            partial = partial._replace(overflow_streak=None)
        partial, stop_partial = next_divergence_state(rule, partial, overflow, finite, 1.0)
        assert int(partial.loss_streak) == int(full.loss_streak)
        assert int(partial.overflow_streak) == int(full.overflow_streak)
        assert bool(stop_partial) == bool(stop_full)
