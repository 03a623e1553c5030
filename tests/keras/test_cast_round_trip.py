"""keras_ext/policy/casts.py: a boundary cast that would undo a widening cast takes the narrow tensor instead.

An FP32 ``LayerNormalization`` inside a bf16 composite gets a bf16 input; Keras' op computes in FP32 and
returns bf16, the layer casts that to FP32, and the boundary cast took it back to bf16: a round trip that
is exact both ways.  The step's graph now has neither cast, and the outputs and gradients are the same
bits as with the round trip (the reference: the same model with the shortcut switched off).
"""

import keras
import numpy as np

import keras_ext
from keras_ext.policy import casts
from tests.keras.helpers.util import requires_tf_backend

pytestmark = requires_tf_backend


class Block(keras.layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(8)
        self.norm = keras.layers.LayerNormalization()

    def call(self, x):
        return self.norm(self.dense(x)) + x


def _run(shortcut, monkeypatch):
    import tensorflow as tf

    if not shortcut:
        monkeypatch.setattr(casts, "_widened_from", lambda value, dtype: None)
    keras_ext.set_global_policy("bf16-mixed")
    keras.utils.set_random_seed(0)
    model = keras_ext.apply_policy(keras.Sequential([keras.Input((8,)), Block(), keras.layers.Dense(1)]))
    x = tf.constant(np.random.default_rng(0).normal(size=(4, 8)).astype("float32"))

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            out = model(x)
            loss = tf.reduce_sum(tf.cast(out, "float32") ** 2)
        return out, tape.gradient(loss, model.trainable_variables)

    out, grads = step(x)
    graph = step.get_concrete_function(x).graph
    casts_in_norm = [op for op in graph.get_operations() if op.type == "Cast" and "layer_normalization" in op.name
                     and "gradient" not in op.name]
    used = [op for op in casts_in_norm if any(c for o in op.outputs for c in o.consumers())]
    monkeypatch.undo()
    return out.numpy(), [g.numpy() for g in grads], len(used)


def test_the_round_trip_is_gone_with_the_same_bits(monkeypatch):
    out, grads, n_casts = _run(True, monkeypatch)
    ref_out, ref_grads, ref_casts = _run(False, monkeypatch)
    assert ref_casts - n_casts == 2  # the layer's cast to FP32 and the boundary cast back
    assert out.dtype == ref_out.dtype and out.tobytes() == ref_out.tobytes()
    for g, r in zip(grads, ref_grads):
        assert g.dtype == r.dtype and g.tobytes() == r.tobytes()


def test_only_a_widening_cast_is_undone():
    import tensorflow as tf

    seen = {}

    @tf.function
    def f(x):
        narrow = tf.cast(x, "bfloat16")  # narrowing: casting back to float32 is not exact
        wide = tf.cast(narrow, "float32")
        seen["narrow"], seen["wide"] = casts._widened_from(narrow, "float32"), casts._widened_from(wide, "bfloat16")
        seen["source"] = narrow
        return wide

    f.get_concrete_function(tf.TensorSpec((2,), tf.float32))
    assert seen["narrow"] is None and seen["wide"] is seen["source"]
    assert casts._widened_from(tf.constant([1.0]), "bfloat16") is None  # eager: no op to look at
