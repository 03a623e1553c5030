"""MonitorCore: cadence, events, fallback and guard, checkpoint round trip."""

import pytest

from mp_callbacks.diagnostics import StepStats
from mp_callbacks.meters import DivergenceError
from mp_callbacks.monitor import MonitorCore


def stats(step, overflow=False, module=None, scale=8.0):
    return StepStats(step=step, scale=scale, overflow=overflow, overflows_total=0, skipped_total=0,
                     growths_total=0, overflow_module=module)


def test_cadence_events_and_fallback():
    m = MonitorCore(log_every_n_steps=5, auto_fallback_after=2)
    assert [s for s in range(1, 16) if m.should_log(s)] == [5, 10, 15]
    assert m.record(stats(3, True, "net.boom")) == []
    assert m.record(stats(7, True, "net.boom")) == ["net.boom"]
    assert m.record(stats(9, True, "net.boom")) == []  # already moved
    kinds = [e["kind"] for e in m.history.events]
    assert kinds == ["overflow", "overflow", "fallback", "overflow"]
    n = MonitorCore(log_every_n_steps=5, auto_fallback_after=2)
    n.load_state_dict(m.state_dict())
    assert n.state_dict() == m.state_dict()
    with pytest.raises(ValueError, match="log_every_n_steps=0"):
        MonitorCore(log_every_n_steps=0)


def test_guard_raises_after_patience_at_floor():
    m = MonitorCore(divergence_patience=2)
    m.record(stats(1, True, scale=1.0), min_scale=1.0)
    m.observe_clean()
    m.record(stats(3, True, scale=1.0), min_scale=1.0)
    with pytest.raises(DivergenceError, match="2 consecutive overflows"):
        m.record(stats(4, True, "net.3", scale=1.0), min_scale=1.0)
