"""keras_ext/loss_scale/divergence.py: the core's divergence rule inside the Keras optimizer's step.

A run whose loss is NaN on every step stops within 10 steps in every recipe, with nothing applied
and the core's message; a gradient overflow at a finite loss below scale 1 stops too; the stop
reaches the host from ``model.fit`` in every execution mode (tf.function, XLA, eager, several
steps per execution, torch backend via test_torch_backend.py) and from a custom loop; the rule
can be turned off and travels in the config.
"""

import keras
import numpy as np
import pytest
from keras import ops

import keras_ext
from mp_callbacks.diagnostics import DivergenceError, DivergenceRule, DivergenceState
from tests.keras.helpers.util import requires_tf_backend

RECIPES = ("32-true", "16-mixed", "bf16-mixed", "16-master", "bf16-master")
LOSS_MESSAGE = "loss was not finite on 5 consecutive steps up to step 5; none of them was applied.*no loss scale fixes"


def _setup(recipe, **kwargs):
    """A Dense-Dense model under ``recipe`` (tiny: fp16 matmul on CPU is slow), compiled, optimizer built."""
    keras_ext.set_global_policy(recipe)
    keras.utils.set_random_seed(0)
    model = keras_ext.apply_policy(keras.Sequential([keras.Input((4,)), keras.layers.Dense(3),
                                                     keras.layers.Dense(1)]))
    compile_kwargs = {k: kwargs.pop(k) for k in ("jit_compile", "run_eagerly", "steps_per_execution") if k in kwargs}
    opt = keras_ext.master_optimizer(keras.optimizers.Adam(1e-2), recipe, **kwargs)
    model.compile(opt, "mse", **compile_kwargs)
    opt.build(model.trainable_variables)
    return model, opt


def _snapshot(model, opt):
    values = list(model.weights) + [m for m in opt.master_variables if m is not None] + \
        list(opt.inner_optimizer.variables)
    return [np.array(ops.convert_to_numpy(v)) for v in values]


def _nan_data(steps, batch=2):
    return np.full((steps * batch, 4), np.nan, "float32"), np.zeros((steps * batch, 1), "float32")


def _fit(model, data, batch=2, **kwargs):
    x, y = data
    return model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0, **kwargs)


def _iterations(opt):
    return int(ops.convert_to_numpy(opt.iterations))


@pytest.mark.parametrize("recipe", RECIPES)
def test_nan_every_step_stops_within_ten_steps_with_nothing_applied(recipe):
    model, opt = _setup(recipe)
    before = _snapshot(model, opt)
    with pytest.raises(DivergenceError, match=LOSS_MESSAGE) as info:
        _fit(model, _nan_data(20))
    assert str(info.value) == str(DivergenceRule().error(5, state=DivergenceState(5, 0)))  # the core's message
    assert opt.steps == opt.skipped == 5 and _iterations(opt) == 0
    for a, b in zip(before, _snapshot(model, opt)):  # weights, masters, slots: bit for bit
        np.testing.assert_array_equal(a, b)
    assert all(np.all(np.isfinite(v)) for v in before)


@requires_tf_backend
@pytest.mark.parametrize("mode", [{"jit_compile": True}, {"run_eagerly": True}, {"steps_per_execution": 4}],
                         ids=["xla", "eager", "steps_per_execution"])
def test_the_stop_reaches_the_host_in_every_execution_mode(mode):
    """Under XLA and in eager mode the stop step raises; with 4 steps per execution the steps after the
    stop (6-8) are skipped with the scaler frozen until the host sees it."""
    model, opt = _setup("bf16-mixed", **mode)
    before = _snapshot(model, opt)
    with pytest.raises(DivergenceError, match=LOSS_MESSAGE):
        _fit(model, _nan_data(12))
    assert opt.steps == opt.skipped == 5 and _iterations(opt) == 0
    for a, b in zip(before, _snapshot(model, opt)):
        np.testing.assert_array_equal(a, b)


class GradInf(keras.layers.Layer):
    """Identity forward, an inf gradient backward: a finite loss whose gradients overflow (TensorFlow)."""

    def call(self, x):
        import tensorflow as tf

        @tf.custom_gradient
        def boost(t):
            return tf.identity(t), lambda dy: dy + float("inf")

        return boost(x)


@requires_tf_backend
def test_overflow_at_a_finite_loss_below_scale_one_stops():
    """The scale backs off 4, 2, 1, 0.5, 0.25, 0.125: the three steps below 1 stop the run."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), GradInf(), keras.layers.Dense(1)])
    opt = keras_ext.LossScaleOptimizer(keras.optimizers.SGD(0.1), {"init_scale": 4.0},
                                       divergence={"overflows_below": 3})
    model.compile(opt, "mse")
    x = np.random.default_rng(0).normal(size=(40, 4)).astype("float32")
    with pytest.raises(DivergenceError, match="overflowed on 3 consecutive steps with a finite loss.*below 1 "
                                              r"\(scale=0.125\) up to step 6; none of them was applied"):
        _fit(model, (x, np.zeros((40, 1), "float32")))
    assert opt.skipped == 6 and opt.current_scale == 0.0625 and _iterations(opt) == 0


def test_the_rule_can_be_turned_off_and_travels_in_the_config():
    model, opt = _setup("bf16-mixed", divergence=False)
    _fit(model, _nan_data(12))
    assert opt.skipped == 12 and not opt.divergence.active
    assert opt.get_config()["divergence"] == {"nonfinite_losses": None, "overflows_below": None, "scale_below": 1.0}
    again = keras_ext.LossScaleOptimizer.from_config(opt.get_config())
    assert again.divergence == DivergenceRule(None, None)
    default = keras_ext.LossScaleOptimizer(keras.optimizers.SGD())
    assert "divergence" not in default.get_config() and default.divergence == DivergenceRule()
    two = keras_ext.LossScaleOptimizer.from_config(
        keras_ext.LossScaleOptimizer(keras.optimizers.SGD(), divergence={"nonfinite_losses": 2}).get_config())
    assert two.divergence.nonfinite_losses == 2 and two.divergence.overflows_below == 10


def test_nothing_is_kept_on_the_device_when_no_step_can_be_skipped():
    """scaler={"enabled": False, "skip_nonfinite": False} applies every step: the rule has nothing to count."""
    model, opt = _setup("bf16-mixed", scaler={"enabled": False, "skip_nonfinite": False})
    assert opt.divergence.active and opt.loss_scaler.config.can_skip is False
    _fit(model, _nan_data(8))
    assert opt.steps == 8 and opt.skipped == 0 and _iterations(opt) == 8
    assert opt._divergence.state() == {}  # no device state
    opt.check_divergence()  # nothing to read


@requires_tf_backend
def test_a_custom_tf_function_loop_checks_with_check_divergence():
    """In a loop of our own the steps after the stop change nothing until check_divergence() raises; the
    latch is then cleared and a finite step applies again."""
    import tensorflow as tf

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    opt = keras_ext.LossScaleOptimizer(keras.optimizers.SGD(0.1), "keras")

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            loss = opt.scale_loss(tf.reduce_mean(tf.square(model(x))))
        opt.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)

    bad, good = tf.fill((2, 4), float("nan")), tf.ones((2, 4))
    for _ in range(7):
        step(bad)
    assert opt.steps == opt.skipped == 5  # frozen after the stop at step 5
    with pytest.raises(DivergenceError, match=LOSS_MESSAGE):
        opt.check_divergence()
    opt.check_divergence()  # raised once
    step(good)
    assert opt.steps == 6 and opt.skipped == 5 and _iterations(opt) == 1


@requires_tf_backend
def test_an_attached_monitor_is_uninstalled_before_the_error_propagates():
    model, opt = _setup("bf16-mixed")
    monitor = keras_ext.MixedPrecisionMonitor(attribute_overflows=True, log_every_n_steps=1)
    with pytest.raises(DivergenceError, match=LOSS_MESSAGE):
        _fit(model, _nan_data(12), callbacks=[monitor])
    assert opt.monitor is None and "train_step" not in model.__dict__
    assert [s.step for s in monitor.history if s.overflow] == [1, 2, 3, 4]  # the 5th raised before it was read
