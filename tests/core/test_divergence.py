"""The divergence rule: non-finite losses vs overflows below scale 1, streaks reset by applied steps."""

import pytest

from mp_callbacks.diagnostics import DivergenceError, DivergenceRule


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


def _by_hand(rule, seq):
    """The rule written out step by step (if/else on Python values): the streaks and the first stop step."""
    loss = over = 0
    for step, (overflow, finite, scale) in enumerate(seq, 1):
        if not overflow:
            loss = over = 0
        elif not finite:
            loss, over = loss + 1, 0
        else:
            loss, over = 0, (over + 1 if scale < rule.scale_below else 0)
        if (rule.nonfinite_losses is not None and loss >= rule.nonfinite_losses) or \
                (rule.overflows_below is not None and over >= rule.overflows_below):
            return step, loss, over
    return None, loss, over


@pytest.mark.parametrize("limits", [(5, 10), (2, None), (None, 3), (1, 1)])
def test_the_pure_transition_equals_the_rule_written_by_hand(limits):
    """next_divergence_state (what Keras evaluates in its traced step) over random step sequences."""
    import numpy as np

    from mp_callbacks.diagnostics import DivergenceState, next_divergence_state

    rng = np.random.default_rng(0)
    for _ in range(300):
        rule = DivergenceRule(*limits)
        n = int(rng.integers(1, 30))
        seq = [(bool(rng.random() < 0.8), bool(rng.random() < 0.5), float(rng.choice([4.0, 1.0, 0.5, 2.0**-10])))
               for _ in range(n)]
        want_stop, want_loss, want_over = _by_hand(rule, seq)
        state, stopped_at = DivergenceState(np.int32(0), np.int32(0)), None
        for step, (overflow, finite, scale) in enumerate(seq, 1):
            state, stop = next_divergence_state(rule, state, overflow, finite, scale)
            if bool(stop):
                stopped_at = step
                break
        assert stopped_at == want_stop
        assert (int(state.loss_streak), int(state.overflow_streak)) == (want_loss, want_over)
        with_observe = DivergenceRule(*limits)  # observe is the same transition on the host
        try:
            for step, (overflow, finite, scale) in enumerate(seq, 1):
                with_observe.observe(step, overflow, finite, scale)
        except DivergenceError:
            assert step == want_stop
        else:
            assert want_stop is None


def test_error_names_the_streak_of_a_given_state():
    from mp_callbacks.diagnostics import DivergenceState

    rule = DivergenceRule()
    assert "loss was not finite on 5 consecutive steps up to step 9" in str(rule.error(9, state=DivergenceState(5, 0)))
    text = str(rule.error(12, 0.25, state=DivergenceState(0, 10)))
    assert "overflowed on 10 consecutive steps" in text and "scale=0.25" in text and "step 12" in text


def test_the_advice_is_ordered_by_what_was_seen_and_names_a_known_culprit():
    from mp_callbacks.advice import checklist

    forward = checklist("loss", compute="float16", module="ffn.down").split(", ")
    assert forward[0].startswith("keep 'ffn.down' in FP32") and "with_fp32_modules('ffn.down')" in forward[0]
    assert forward[1].startswith("switch float16 to bfloat16")
    assert not any("overflow attribution" in item for item in forward)  # the culprit is known already
    unknown = checklist("loss", compute="float16").split(", ")
    assert not any(item.startswith("keep '") for item in unknown) and "overflow attribution" in unknown[-1]
    gradients = checklist("overflow", compute="float16", module="ffn.down").split(", ")
    assert gradients[:2] == ["lower the learning rate (or warm it up)", "clip gradients"]
    assert not any("bfloat16" in item for item in checklist("loss", compute="bfloat16").split(", "))
    with pytest.raises(ValueError, match="cause"):
        checklist("underflow")


def test_a_stop_with_a_known_module_names_it_first_in_the_advice():
    rule = DivergenceRule(nonfinite_losses=2, compute="float16")
    rule.observe(1, overflow=True, loss_finite=False, module="ffn.down")
    with pytest.raises(DivergenceError) as info:
        rule.observe(2, overflow=True, loss_finite=False, module="ffn.down")
    message = str(info.value)
    assert "first non-finite module 'ffn.down'" in message
    assert message.split("Try: ", 1)[1].startswith("keep 'ffn.down' in FP32")
    assert "turn on overflow attribution" not in message
