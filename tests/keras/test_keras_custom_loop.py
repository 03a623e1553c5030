"""Custom tf.GradientTape loops, the tf-keras API and skip semantics."""

import numpy as np
import pytest
from keras_testutil import requires_tf_backend

tf = pytest.importorskip("tensorflow")

import keras
from keras import ops

import keras_ext
from mp_callbacks import ScaleFloorError, ScalerConfig


pytestmark = requires_tf_backend


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


def test_skip_leaves_variables_slots_and_iterations_untouched():
    """On an overflow nothing the model learns from moves; only the scaler state changes."""
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


def test_floor_raise_in_eager_loop():
    """on_min_scale='raise' surfaces the core's ScaleFloorError (eager) when the floor is hit."""
    model = _model()
    cfg = ScalerConfig.preset("tf-keras", init_scale=2.0, on_min_scale="raise")
    opt = keras_ext.LossScaleOptimizer(keras.optimizers.SGD(0.1), cfg)
    bad = [tf.fill(v.shape, float("inf")) for v in model.trainable_variables]
    opt.apply(bad, model.trainable_variables)  # 2 -> 1
    assert opt.current_scale == 1.0
    with pytest.raises(ScaleFloorError, match="floor"):
        opt.apply(bad, model.trainable_variables)
