"""keras_ext/tf_cond.py: the cond around the update runs as one function call, with the lowered cond's numbers.

In a traced TensorFlow step the optimizer's ``If`` is marked not to be lowered to Switch/Merge; the weights,
slots and scaler counters of a run with skipped steps are bit for bit those of the same run with TensorFlow's
lowering (and ``test_optimizer.py``'s parity tests compare the same step with Keras' own optimizer); under a
``tf.distribute`` strategy the ``If`` keeps TensorFlow's lowering.
"""

import keras
import numpy as np
import pytest
from keras import ops

import keras_ext
from keras_ext import tf_cond
from tests.keras.helpers.util import requires_tf_backend

pytestmark = requires_tf_backend


def _lowering(graph):
    """``_lower_using_switch_merge`` of every ``If`` in ``graph`` (the attribute's value, None if unset)."""
    out = []
    for op in graph.get_operations():
        if op.type in ("If", "StatelessIf"):
            try:
                out.append(op.get_attr("_lower_using_switch_merge"))
            except ValueError:
                out.append(None)
    return out


def _run(recipe):
    """Eight steps of a custom tf.function loop (steps 3 and 6 overflow): values, counters, the step's Ifs."""
    import tensorflow as tf

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8), keras.layers.Dense(1)])
    opt = keras_ext.master_optimizer(keras.optimizers.AdamW(1e-2), recipe)
    opt.build(model.trainable_variables)

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = opt.scale_loss(tf.reduce_mean(tf.square(model(x) - y)))
        opt.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)

    rng = np.random.default_rng(0)
    for i in range(8):
        x = rng.normal(size=(4, 4)).astype("float32") * (np.inf if i in (2, 5) else 1.0)
        step(tf.constant(x), tf.constant(np.ones((4, 1), "float32")))
    graph = step.get_concrete_function(tf.TensorSpec((4, 4)), tf.TensorSpec((4, 1))).graph
    values = [np.array(ops.convert_to_numpy(v)) for v in [*model.weights, *opt.inner_optimizer.variables]]
    return values, (opt.steps, opt.skipped, int(ops.convert_to_numpy(opt.iterations))), _lowering(graph)


@pytest.mark.parametrize("recipe", ["32-true", "16-mixed"])
def test_the_update_runs_as_one_call_with_the_lowered_conds_numbers(recipe, monkeypatch):
    values, counts, lowering = _run(recipe)
    with monkeypatch.context() as m:
        m.setattr(tf_cond, "unlowers", lambda: False)
        ref_values, ref_counts, ref_lowering = _run(recipe)
    assert False in lowering and True not in lowering  # ours: the update's If is a function call
    assert True in ref_lowering  # TensorFlow's own: lowered
    assert counts == ref_counts == (8, 2, 6)
    assert len(values) == len(ref_values)
    for a, b in zip(values, ref_values):
        np.testing.assert_array_equal(a, b)


def test_a_strategy_in_scope_keeps_the_lowering():
    import tensorflow as tf

    with tf.distribute.OneDeviceStrategy("/cpu:0").scope():
        @tf.function
        def f(p):
            tf_cond.cond(p, lambda: None)
            return tf.constant(0)

        graph = f.get_concrete_function(tf.TensorSpec((), tf.bool)).graph
    assert not tf_cond.unlowers() and False not in _lowering(graph)
