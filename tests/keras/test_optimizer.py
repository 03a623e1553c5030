"""keras_ext.LossScaleOptimizer (keras_ext/optimizer.py): the Keras-facing optimizer.

Argument errors and Keras' own arguments, the serialized config (shaped like Keras' own),
the recipe it carries, the monitor port, custom tf.GradientTape loops and the tf-keras API,
skip semantics (also without loss scaling: ``skip_nonfinite``, and its opt-out without any finite
check), equality with stock Keras' LossScaleOptimizer (``keras`` preset), and the cross-replica
overflow decision under MirroredStrategy (with and without loss scaling; the non-finite-loss flag
of the divergence rule too).
"""

import json

import keras
import numpy as np
import pytest
from keras import ops

import keras_ext
from mp_callbacks import ConfigError, ScalerConfig
from mp_callbacks.loss_scale import checks_overflow
from tests.keras.helpers import stock_parity
from tests.keras.helpers.util import requires_tf_backend, run_script

KERAS_CONFIG_KEYS = {"name", "inner_optimizer", "initial_scale", "dynamic_growth_steps"}


def _tf():
    import tensorflow as tf

    return tf


# ------------------------------------------------------------------ arguments
def test_unknown_preset_lists_valid_ones():
    with pytest.raises(ConfigError, match="unknown scaler preset 'kerass'.*keras"):
        keras_ext.LossScaleOptimizer(keras.optimizers.SGD(), "kerass")


def test_inner_must_be_an_optimizer():
    with pytest.raises(TypeError, match="keras.optimizers.Optimizer"):
        keras_ext.LossScaleOptimizer("sgd")
    with pytest.raises(TypeError, match="already a LossScaleOptimizer"):
        keras_ext.LossScaleOptimizer(keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD()))


def test_bad_config_values():
    with pytest.raises(ConfigError, match="growth_interval"):
        keras_ext.LossScaleOptimizer(keras.optimizers.SGD(), dynamic_growth_steps=0)
    with pytest.raises(ConfigError, match="unknown ScalerConfig field"):
        keras_ext.LossScaleOptimizer(keras.optimizers.SGD(), {"init_scael": 2.0})
    with pytest.raises(ValueError, match="does not support"):
        keras_ext.LossScaleOptimizer(keras.optimizers.SGD(), clipnorm=1.0)
    with pytest.raises(ValueError, match="unknown recipe"):
        keras_ext.master_optimizer(keras.optimizers.SGD(), "bf16-masterr")


def test_drop_in_arguments():
    """Keras' own arguments still work (positional initial_scale, dynamic_growth_steps)."""
    opt = keras_ext.LossScaleOptimizer(keras.optimizers.SGD(), 1024.0, dynamic_growth_steps=7)
    assert opt.scaler_config == ScalerConfig.preset("keras", init_scale=1024.0, growth_interval=7)
    assert opt.current_scale == 1024.0 and opt.steps == 0
    assert isinstance(opt, keras.optimizers.LossScaleOptimizer)
    assert keras_ext.LossScaleOptimizer(keras.optimizers.SGD()).scaler_config == ScalerConfig.preset("keras")


def test_compile_does_not_double_wrap():
    """Under Keras' mixed_float16, compile() keeps our optimizer instead of wrapping it again."""
    keras.config.set_dtype_policy("mixed_float16")
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    opt = keras_ext.LossScaleOptimizer(keras.optimizers.SGD())
    model.compile(opt, "mse")
    assert model.optimizer is opt


# --------------------------------------------------------------- serialization
def test_get_config_is_shaped_like_keras_own_for_the_default_scaler():
    """Keras' own test_serialization: exactly its four keys, and its from_config takes them."""
    opt = keras_ext.LossScaleOptimizer(keras.optimizers.SGD(0.5), initial_scale=3.0, dynamic_growth_steps=2,
                                       name="test_opt")
    config = opt.get_config()
    assert set(config) == KERAS_CONFIG_KEYS
    assert (config["name"], config["initial_scale"], config["dynamic_growth_steps"]) == ("test_opt", 3.0, 2)
    again = keras_ext.LossScaleOptimizer.from_config(config)
    assert again.scaler_config == opt.scaler_config == ScalerConfig.preset("keras", init_scale=3.0, growth_interval=2)
    stock = keras.optimizers.LossScaleOptimizer.from_config(opt.get_config())  # Keras reads ours
    assert (stock.initial_scale, stock.dynamic_growth_steps) == (3.0, 2)
    ours = keras_ext.LossScaleOptimizer.from_config(stock.get_config())  # and we read Keras'
    assert ours.scaler_config == opt.scaler_config and not ours.master_weights


@pytest.mark.parametrize("kwargs,extra", [
    ({"scaler": "megatron"}, {"scaler"}),
    ({"master_weights": True}, {"master_weights"}),
    ({"count_overflows": False}, {"count_overflows"}),
    ({"recipe": "16-mixed"}, {"recipe"}),  # the recipe's scaler is the default then
    ({"recipe": "16-mixed", "scaler": "megatron"}, {"recipe", "scaler"}),
    ({"recipe": "bf16-master", "master_weights": False}, {"recipe", "master_weights"}),
])
def test_get_config_carries_our_fields_only_where_they_differ_and_round_trips(kwargs, extra):
    opt = keras_ext.LossScaleOptimizer(keras.optimizers.SGD(0.1), name="lso", **kwargs)
    config = opt.get_config()
    assert set(config) == KERAS_CONFIG_KEYS | extra
    json.dumps(config)  # plain data
    again = keras_ext.LossScaleOptimizer.from_config(config)
    assert again.get_config() == config
    assert (again.scaler_config, again.master_weights, again.count_overflows, again.recipe) == \
        (opt.scaler_config, opt.master_weights, opt.count_overflows, opt.recipe)


def test_from_config_reads_configs_of_earlier_versions():
    inner = keras.saving.serialize_keras_object(keras.optimizers.SGD(0.1))
    old = {"name": "lso", "inner_optimizer": inner, "scaler": ScalerConfig.preset("megatron").to_dict(),
           "master_weights": True, "count_overflows": None}
    opt = keras_ext.LossScaleOptimizer.from_config(old)
    assert opt.scaler_config == ScalerConfig.preset("megatron") and opt.master_weights


# ---------------------------------------------------------------------- recipe
def test_recipe_comes_from_master_optimizer_the_keyword_or_the_global_policy():
    opt = keras_ext.master_optimizer(keras.optimizers.SGD(), "bf16-master", scaler="megatron")
    assert opt.recipe.name == "bf16-master" and opt.master_weights
    assert opt.recipe.scaler == opt.scaler_config == ScalerConfig.preset("megatron")
    assert keras_ext.LossScaleOptimizer(keras.optimizers.SGD()).recipe.name == "32-true"
    assert keras_ext.LossScaleOptimizer(keras.optimizers.SGD(), recipe="16-master").master_weights
    keras_ext.set_global_policy("16-mixed")
    opt = keras_ext.LossScaleOptimizer(keras.optimizers.SGD())
    assert opt.recipe.name == "16-mixed" and opt.recipe.scaler == opt.scaler_config == ScalerConfig.preset("keras")
    assert keras_ext.LossScaleOptimizer(keras.optimizers.SGD(), master_weights=True).recipe.name == "16-master"
    keras.config.set_dtype_policy("mixed_bfloat16")  # Keras' own policy: the recipe with its dtypes
    assert keras_ext.LossScaleOptimizer(keras.optimizers.SGD()).recipe.name == "bf16-mixed"
    keras_ext.set_global_policy("bf16-master")
    policy = keras_ext.get_global_policy()
    assert keras_ext.LossScaleOptimizer(keras.optimizers.SGD(), master_weights=True).recipe.policy is policy
    with pytest.raises(TypeError, match="recipe must be"):
        keras_ext.LossScaleOptimizer(keras.optimizers.SGD(), recipe=3)


# ---------------------------------------------------------------- monitor port
def test_monitor_port_attaches_one_monitor_and_follows_the_core_overflow_check_rule():
    opt = keras_ext.LossScaleOptimizer(keras.optimizers.SGD(), {"enabled": False})

    def rule():
        return checks_overflow(opt.scaler_config, opt.count_overflows, opt.monitor is not None)

    assert opt.checks_overflow == rule() and opt.monitor is None and not opt.monitored
    monitor = keras_ext.MixedPrecisionMonitor()
    opt.attach_monitor(monitor)
    assert opt.checks_overflow and opt.checks_overflow == rule() and opt.monitor is monitor and opt.monitored
    opt.detach_monitor(keras_ext.MixedPrecisionMonitor())  # another one: nothing happens
    assert opt.monitor is monitor
    opt.detach_monitor(monitor)
    assert opt.monitor is None and opt.checks_overflow == rule()
    opt.count_overflows = True
    assert opt.checks_overflow
    with pytest.raises(TypeError, match="count_overflows"):
        keras_ext.LossScaleOptimizer(keras.optimizers.SGD(), count_overflows="yes")


# -------------------------------------------------------------- custom loops
def _model(seed=2):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((3,)), keras.layers.Dense(4), keras.layers.Dense(1)])


def _batches(n=8, bad=(2, 5)):
    rng = np.random.default_rng(1)
    out = []
    for i in range(n):
        x = rng.normal(size=(4, 3)).astype("float32")
        y = x.sum(axis=1, keepdims=True)
        if i in bad:
            x[1, 2] = np.inf
        out.append((x, y))
    return out


def _values(vs):
    return [np.array(ops.convert_to_numpy(v)) for v in vs]


def _train(opt, model, style, compiled=True):
    tf = _tf()

    def step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x, training=True) - y))
            scaled = opt.get_scaled_loss(loss) if style == "tf-keras" else opt.scale_loss(loss)
        grads = tape.gradient(scaled, model.trainable_variables)
        if style == "tf-keras":
            grads = opt.get_unscaled_gradients(grads)
            opt.apply_gradients(zip(grads, model.trainable_variables))
        else:
            opt.apply(grads, model.trainable_variables)

    fn = tf.function(step) if compiled else step
    scales = []
    for x, y in _batches():
        fn(tf.constant(x), tf.constant(y))
        scales.append(float(ops.convert_to_numpy(opt.dynamic_scale)))
    return scales


@requires_tf_backend
@pytest.mark.parametrize("compiled", [True, False], ids=["tf.function", "eager"])
def test_gradient_tape_loop_matches_stock(compiled):
    """A tf.GradientTape loop with scale_loss/apply: same as stock Keras' optimizer."""
    m1, m2 = _model(), _model()
    stock = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.05, momentum=0.9), dynamic_growth_steps=2)
    ours = keras_ext.LossScaleOptimizer(keras.optimizers.SGD(0.05, momentum=0.9), dynamic_growth_steps=2)
    s1 = _train(stock, m1, "keras3", compiled)
    s2 = _train(ours, m2, "keras3", compiled)
    assert s1 == s2
    assert ours.skipped == 2 and ours.overflows == 2 and ours.steps == 8 and ours.growths >= 1
    for a, b in zip(_values(m1.weights), _values(m2.weights)):
        np.testing.assert_array_equal(a, b)


@requires_tf_backend
def test_tf_keras_api_matches_keras3_style():
    """get_scaled_loss + get_unscaled_gradients + apply_gradients (tf-keras) == scale_loss + apply."""
    m1, m2 = _model(), _model()
    o1 = keras_ext.LossScaleOptimizer(keras.optimizers.Adam(1e-2), dynamic_growth_steps=2)
    o2 = keras_ext.LossScaleOptimizer(keras.optimizers.Adam(1e-2), dynamic_growth_steps=2)
    s1 = _train(o1, m1, "keras3")
    s2 = _train(o2, m2, "tf-keras")
    assert s1 == s2
    for a, b in zip(_values(m1.weights), _values(m2.weights)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    assert o2.skipped == 2


@requires_tf_backend
def test_skip_leaves_variables_slots_and_iterations_untouched():
    """On an overflow nothing the model learns from moves; only the scaler state changes."""
    tf = _tf()
    model = _model()
    opt = keras_ext.LossScaleOptimizer(keras.optimizers.Adam(1e-2), "keras")
    x = np.ones((2, 3), "float32")
    y = np.ones((2, 1), "float32")

    def grads_for(xv):
        with tf.GradientTape() as tape:
            loss = opt.scale_loss(tf.reduce_mean(tf.square(model(xv) - y)))
        return tape.gradient(loss, model.trainable_variables)

    opt.apply(grads_for(x), model.trainable_variables)  # one clean step builds the slots
    weights, slots = _values(model.weights), _values(opt.inner_optimizer.variables)
    iterations = int(ops.convert_to_numpy(opt.iterations))
    bad = x.copy()
    bad[0, 0] = np.nan
    opt.apply(grads_for(bad), model.trainable_variables)
    for a, b in zip(weights, _values(model.weights)):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(slots, _values(opt.inner_optimizer.variables)):
        np.testing.assert_array_equal(a, b)
    assert int(ops.convert_to_numpy(opt.iterations)) == iterations == 1
    assert opt.current_scale == 2.0**14 and opt.skipped == 1 and opt.steps == 2
    assert opt.scaler_metrics() == {"mp/scale": 2.0**14, "mp/overflows_total": 1.0,
                                    "mp/skipped_total": 1.0, "mp/growths_total": 0.0}
    sd = opt.scaler_state_dict()
    assert sd["state"]["overflows"] == 1 and sd["config"]["init_scale"] == 2.0**15


def _recipe_fit(recipe, **kwargs):
    """A Dense-Dense model and its optimizer under ``recipe``; 3 batches of 2, the last with an inf sample weight."""
    keras_ext.set_global_policy(recipe)
    keras.utils.set_random_seed(0)
    model = keras_ext.apply_policy(keras.Sequential([keras.Input((4,)), keras.layers.Dense(3),
                                                     keras.layers.Dense(1)]))
    opt = keras_ext.master_optimizer(keras.optimizers.Adam(1e-2), recipe, **kwargs)
    model.compile(opt, "mse")
    x = np.random.default_rng(0).normal(size=(6, 4)).astype("float32")
    w = np.array([1, 1, 1, 1, np.inf, 1], "float32")
    return model, opt, (x, x[:, :1], w)


def _fit_rows(model, data, rows):
    x, y, w = data
    model.fit(x[rows], y[rows], sample_weight=w[rows], batch_size=2, shuffle=False, verbose=0)


@pytest.mark.parametrize("recipe", ["32-true", "bf16-mixed", "bf16-master"])
def test_recipes_without_loss_scaling_skip_non_finite_steps_by_default(recipe):
    """ScalerConfig.skip_nonfinite (default): weights, masters, slots and iterations stay bit for bit."""
    model, opt, data = _recipe_fit(recipe)
    assert not opt.scaler_config.enabled and opt.scaler_config.can_skip and opt.checks_overflow  # no monitor
    _fit_rows(model, data, slice(0, 4))
    state = list(model.weights) + [m for m in opt.master_variables if m is not None] + opt.inner_optimizer.variables
    before = _values(state)
    _fit_rows(model, data, slice(4, 6))
    for a, b in zip(before, _values(state)):
        np.testing.assert_array_equal(a, b)
    assert (opt.steps, opt.overflows, opt.skipped, opt.current_scale) == (3, 1, 1, 1.0)
    assert int(ops.convert_to_numpy(opt.iterations)) == 2
    assert sum(m is not None for m in opt.master_variables) == (2 if recipe == "bf16-master" else 0)  # head: FP32


def test_opting_out_applies_every_step_without_any_finite_check(monkeypatch):
    def no_check(grads):
        raise AssertionError("the opt-out must not look at the gradients")

    monkeypatch.setattr(keras_ext.optimizer, "found_inf", no_check)
    model, opt, data = _recipe_fit("bf16-mixed", scaler={"enabled": False, "skip_nonfinite": False})
    assert not opt.checks_overflow
    _fit_rows(model, data, slice(0, 6))
    assert (opt.steps, opt.overflows, opt.skipped) == (3, 0, 0) and int(ops.convert_to_numpy(opt.iterations)) == 3
    assert not np.all(np.isfinite(ops.convert_to_numpy(model.weights[0])))  # the inf step was applied


# ------------------------------------------------------------ stock Keras parity
def _assert_same(result, exact=True):
    stock, ours = result["stock"], result["ours"]
    # The scale after every batch, and the inner optimizer's step count (skips do not count).
    assert ours["scales"] == stock["scales"]
    assert ours["iterations"] == stock["iterations"]
    # Overflows happened, were skipped, and the scale grew in between.
    counters = ours["counters"]
    # growths: the number of times stock Keras' scale went up, read off its own trajectory
    stock_growths = sum(b > a for a, b in zip(stock["scales"], stock["scales"][1:]))
    assert counters == {"steps": 16, "overflows": 4, "skipped": 4, "growths": stock_growths}
    assert stock_growths >= 2
    assert ours["iterations"][-1] == 16 - 4
    assert len(set(ours["scales"])) >= 3
    for key in ("weights", "inner_slots"):
        assert len(stock[key]) == len(ours[key]), key  # a missing weight or slot is a failure, not a skip
        for a, b in zip(stock[key], ours[key]):
            if exact:
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
            else:
                np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
        assert np.all(np.isfinite(np.concatenate([np.ravel(np.asarray(a)) for a in ours[key]])))


def test_fit_matches_stock_keras():
    """Scale sequence, skipped steps, final weights and Adam slots: bit-identical.

    Runs on the session's backend; test_torch_backend.py runs it again with
    KERAS_BACKEND=torch in a fresh pytest process.
    """
    result = stock_parity.compare()
    assert result["backend"] == keras.backend.backend()
    _assert_same(result, exact=keras.backend.backend() != "jax")  # JAX: XLA compiles both steps, as jit_compile


@requires_tf_backend
def test_fit_matches_stock_keras_jit_compile():
    """Same run under XLA (jit_compile=True): identical decisions, weights equal up to XLA fusion."""
    _assert_same(stock_parity.compare(jit_compile=True), exact=False)


# -------------------------------------------------------------- distribution
@requires_tf_backend
def test_one_replica_overflow_makes_every_replica_skip():
    proc = run_script("mirrored", "ours", "fit", "fit_master", "fit_bf16", "diverge")
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    result = json.loads(line[len("RESULT "):])

    loop = result["ours"]
    assert loop["replicas"] == 2
    # Steps 1 and 4 overflow on replica 1 only: the flag is all-reduced, both replicas skip.
    assert loop["unchanged_on_bad"] == [True, True]
    assert loop["skipped"] == loop["overflows"] == 2 and loop["steps"] == 6
    assert loop["iterations"] == 4
    assert loop["weights_equal_across_replicas"] and loop["finite"]
    assert loop["scales"] == [32768.0, 16384.0, 16384.0, 32768.0, 16384.0, 16384.0]

    # model.fit; fit_bf16: no loss scaling, the step is skipped all the same (ScalerConfig.skip_nonfinite)
    for kind, masters in (("fit", 0), ("fit_master", 2), ("fit_bf16", 0)):
        fit = result[kind]
        assert fit["skipped"] == fit["overflows"] == 1 and fit["steps"] == 6 and fit["iterations"] == 5
        assert fit["weights_equal_across_replicas"] and fit["finite"]  # masters included
        assert fit["masters"] == masters and fit["scaling"] == (kind != "fit_bf16")
    # the second replica's loss is NaN on every step: the non-finite-loss flag is summed across replicas too
    diverge = result["diverge"]
    assert diverge["error"].startswith("DivergenceError: training diverged: the loss was not finite on 5 "
                                       "consecutive steps up to step 5")
    assert diverge["skipped"] == diverge["steps"] == 5 and diverge["iterations"] == 0
    assert diverge["weights_equal_across_replicas"] and diverge["finite"]
