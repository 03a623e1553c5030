"""Reduced form of the TensorFlow multi-worker block of docs/guides/scaling-out.md.

There: one process per worker under ``MultiWorkerMirroredStrategy``.  Here: the same build, compile
(``comm_dtype="bfloat16"``: the optimizer all-reduces the gradients itself, in bf16) and fit under
``MirroredStrategy`` over 2 logical CPU devices of one process, so the cross-replica overflow
consensus and the bf16 reduction run.  ``tests/keras/test_multiworker.py`` runs 2 worker processes."""

import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
import tensorflow as tf  # noqa: E402

cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_ext  # noqa: E402
import keras_ext.distributed  # noqa: E402
from mp_callbacks import get_recipe  # noqa: E402


def build_model():
    return keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(1)])


loss = "mse"
rng = np.random.default_rng(0)
dataset = tf.data.Dataset.from_tensor_slices((rng.normal(size=(64, 8)).astype("float32"),
                                              rng.normal(size=(64, 1)).astype("float32"))).batch(16)

strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])      # the block: MultiWorkerMirroredStrategy()
assert strategy.num_replicas_in_sync == 2
with strategy.scope():
    model = build_model()
    model.compile(keras_ext.LossScaleOptimizer(keras.optimizers.AdamW(1e-3),
                  recipe=get_recipe("16-mixed", comm_dtype="bfloat16")), loss)
keras_ext.distributed.multi_worker_fit(model)
model.fit(dataset, epochs=1, verbose=0)
assert int(model.optimizer.iterations.numpy()) == 4
print("keras multi-worker reduced form: OK")
