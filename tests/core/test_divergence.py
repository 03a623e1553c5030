"""The divergence rule: non-finite losses vs overflows below scale 1, streaks reset by applied steps."""

import pytest

from mp_callbacks.divergence import DivergenceRule
from mp_callbacks.meters import DivergenceError


def test_nonfinite_losses_stop_after_the_limit_and_say_why():
    rule = DivergenceRule(nonfinite_losses=3)
    for step in (1, 2):
        rule.observe(step, overflow=True, loss_finite=False, scale=65536.0)
    with pytest.raises(DivergenceError, match="loss was not finite on 3 consecutive steps up to step 3.*no loss scale"):
        rule.observe(3, overflow=True, loss_finite=False, scale=32768.0)


def test_overflows_count_only_below_the_scale_limit():
    rule = DivergenceRule(nonfinite_losses=None, overflows_below=2)
    for step in range(1, 20):  # a high scale overflowing is what loss scaling handles
        rule.observe(step, overflow=True, loss_finite=True, scale=2.0**10)
    rule.observe(20, overflow=True, loss_finite=True, scale=0.5)
    with pytest.raises(DivergenceError, match="overflowed on 2 consecutive steps.*scale=0.25"):
        rule.observe(21, overflow=True, loss_finite=True, scale=0.25, module="net.1")


def test_an_applied_step_resets_both_streaks_and_state_round_trips():
    rule = DivergenceRule(nonfinite_losses=2, overflows_below=2)
    rule.observe(1, overflow=True, loss_finite=False)
    rule.observe(2, overflow=False)
    rule.observe(3, overflow=True, loss_finite=False)  # 1 again, no stop
    assert rule.loss_streak == 1
    other = DivergenceRule(nonfinite_losses=2)
    other.load_state_dict(rule.state_dict())
    with pytest.raises(DivergenceError):
        other.observe(4, overflow=True, loss_finite=False)


def test_coerce_and_validation():
    assert not DivergenceRule.coerce(False).active and DivergenceRule.coerce(None).nonfinite_losses == 5
    assert DivergenceRule.coerce({"nonfinite_losses": 2}).nonfinite_losses == 2
    with pytest.raises(ValueError, match="nonfinite_losses"):
        DivergenceRule(nonfinite_losses=0)
    with pytest.raises(TypeError, match="divergence"):
        DivergenceRule.coerce("yes")
