"""MonitorCore: cadence, events, fallback and guard, checkpoint round trip."""

import pytest

from mp_callbacks.diagnostics import (
    LOSS_SOURCE,
    MONITOR_SCHEMA_VERSION,
    DivergenceError,
    MonitorCore,
    StepStats,
    attribution_order,
    first_culprit,
    fraction,
    json_safe,
)
from mp_callbacks.memory import optimizer_kind


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


@pytest.mark.parametrize("kw", [{"divergence_patience": 0}, {"divergence_patience": -1},
                                {"auto_fallback_after": 0}, {"auto_fallback_after": -3}])
def test_zero_or_negative_guard_and_fallback_are_errors_none_is_off(kw):
    with pytest.raises(ValueError, match="must be an integer >= 1"):
        MonitorCore(**kw)
    off = MonitorCore(divergence_patience=None, auto_fallback_after=None)
    assert off.guard is None and off.fallback is None


def test_should_record_every_logging_step_and_every_overflow():
    m = MonitorCore(log_every_n_steps=4)
    assert [s for s in range(1, 10) if m.should_record(s, overflow=s == 3)] == [3, 4, 8]


def test_the_loss_is_recorded_but_never_moved_to_fp32():
    m = MonitorCore(auto_fallback_after=1)
    assert m.record(stats(1, True, LOSS_SOURCE)) == []
    assert m.fallback.blame == {} and [e["kind"] for e in m.history.events] == ["overflow"]
    assert m.record(stats(2, True, "net.1")) == ["net.1"]


def test_envelope_round_trip_and_clear_errors():
    m = MonitorCore(log_every_n_steps=3, divergence_patience=5, auto_fallback_after=2)
    m.record(stats(1, True, "a"))
    env = m.envelope("x.Monitor", 7)
    assert env["schema"] == "x.Monitor" and env["schema_version"] == MONITOR_SCHEMA_VERSION and env["step"] == 7
    n = MonitorCore(log_every_n_steps=3, divergence_patience=5, auto_fallback_after=2)
    assert n.load_envelope("x.Monitor", env) == 7 and n.state_dict() == m.state_dict()
    with pytest.raises(ValueError, match="holds monitor schema 'y.Monitor'; this callback reads 'x.Monitor'"):
        n.load_envelope("x.Monitor", {**env, "schema": "y.Monitor"})
    with pytest.raises(ValueError, match="the state holds x.Monitor schema v99"):
        n.load_envelope("x.Monitor", {**env, "schema_version": 99}, "state")
    with pytest.raises(ValueError, match="'list'"):
        n.load_envelope("x.Monitor", [])
    assert repr(m) == "MonitorCore(log_every_n_steps=3, divergence_patience=5, auto_fallback_after=2)"


def test_first_culprit_order():
    assert first_culprit(["a", "b"], True, ["c"]) == "a"  # forward outputs first, in call order
    assert first_culprit([], True, ["c", "b"]) == LOSS_SOURCE  # then the loss
    assert first_culprit([], False, ["c", "b"]) == "c"  # then gradients, in backward order
    assert first_culprit([], False, []) is None
    assert attribution_order(["a", "b"], ["b", "a"]) == ["a", "b", LOSS_SOURCE, "b", "a"]


def test_step_stats_from_counts_and_fraction():
    s = StepStats.from_counts(3, 8.0, 1.0, 2.0, 2.0, 0.0, grad_norm=1.5, underflow=(1.0, 4.0),
                              swamped=(0.0, 0.0), overflow_module="m")
    assert s == StepStats(step=3, scale=8.0, overflow=True, overflows_total=2, skipped_total=2, growths_total=0,
                          grad_norm=1.5, grad_underflow_frac=0.25, update_swamped_frac=0.0, overflow_module="m")
    assert StepStats.from_counts(1, 1.0, False, 0, 0, 0).grad_underflow_frac is None
    assert fraction(3, 4) == 0.75 and fraction(0, 0) == 0.0


def test_json_safe_and_optimizer_kind():
    assert json_safe({"a": [float("inf"), 1.0, (float("nan"),)], 2: "x"}) == {"a": ["inf", 1.0, ["nan"]], "2": "x"}
    assert optimizer_kind("SGD", 0.9) == "sgd-momentum" and optimizer_kind("SGD") == "sgd"
    assert optimizer_kind("AdamW") == "adamw"


def test_attribution_is_opt_in_unless_fallback_needs_it():
    from mp_callbacks.diagnostics import MonitorFacade

    def setup(**kw):
        m = MonitorFacade()
        args = dict(log_every_n_steps=1, divergence_patience=None, auto_fallback_after=None,
                    attribute_overflows=None, measure_grads=True, measure_swamping=True, log_memory=True,
                    history_maxlen=10)
        args.update(kw)
        m._setup(**args)
        return m.attribute_overflows

    assert setup() is False
    assert setup(auto_fallback_after=2) is True
    assert setup(attribute_overflows=True) is True
    assert setup(auto_fallback_after=2, attribute_overflows=False) is False
