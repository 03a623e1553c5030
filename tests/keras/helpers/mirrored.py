"""Run by tests/keras/test_optimizer.py in a fresh process (TF must not be initialized):
``python -m tests.keras.helpers.mirrored ours fit fit_master``.

Splits the CPU into 2 logical devices, trains a tiny model under
MirroredStrategy with a custom loop where only replica 1's batch overflows at
chosen steps, and prints one JSON line with what happened.
"""

import json
import os
import sys

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
import numpy as np
import tensorflow as tf

cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)

import keras  # noqa: E402

import keras_ext  # noqa: E402

BAD_STEPS = {1, 4}
STEPS = 6


def batches():
    rng = np.random.default_rng(0)
    out = []
    for step in range(STEPS):
        per_replica = []
        for replica in range(2):
            x = rng.normal(size=(4, 3)).astype("float32")
            y = x.sum(axis=1, keepdims=True).astype("float32")
            if replica == 1 and step in BAD_STEPS:
                x[0, 0] = np.inf
            per_replica.append((x, y))
        out.append(per_replica)
    return out


def run(kind):
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    with strategy.scope():
        keras.utils.set_random_seed(3)
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2), keras.layers.Dense(1)])
        inner = keras.optimizers.SGD(0.05, momentum=0.9)
        if kind == "ours":
            opt = keras_ext.LossScaleOptimizer(inner, "keras", dynamic_growth_steps=2)
        else:
            opt = keras.optimizers.LossScaleOptimizer(inner, dynamic_growth_steps=2)
        opt.build(model.trainable_variables)

    @tf.function
    def train_step(dist_x, dist_y):
        def step(x, y):
            with tf.GradientTape() as tape:
                pred = model(x, training=True)
                loss = tf.reduce_mean(tf.square(pred - y)) / strategy.num_replicas_in_sync
                scaled = opt.scale_loss(loss)
            grads = tape.gradient(scaled, model.trainable_variables)
            opt.apply(grads, model.trainable_variables)

        strategy.run(step, args=(dist_x, dist_y))

    record = {"scales": [], "weights_equal_across_replicas": True, "finite": True}
    data = batches()
    before_bad = {}
    for i, per_replica in enumerate(data):
        xs = strategy.experimental_distribute_values_from_function(
            lambda ctx, per_replica=per_replica: per_replica[ctx.replica_id_in_sync_group][0])
        ys = strategy.experimental_distribute_values_from_function(
            lambda ctx, per_replica=per_replica: per_replica[ctx.replica_id_in_sync_group][1])
        if i in BAD_STEPS:
            before_bad[i] = [np.array(v.numpy()) for v in model.trainable_variables]
        train_step(xs, ys)
        if i in BAD_STEPS:
            after = [np.array(v.numpy()) for v in model.trainable_variables]
            record.setdefault("unchanged_on_bad", []).append(
                all(np.array_equal(a, b) for a, b in zip(before_bad[i], after)))
        record["scales"].append(float(np.asarray(opt.dynamic_scale.numpy())))
        for v in model.trainable_variables:
            tv = v.value if hasattr(v, "value") else v
            parts = strategy.experimental_local_results(tv)
            if not all(np.array_equal(parts[0].numpy(), p.numpy()) for p in parts[1:]):
                record["weights_equal_across_replicas"] = False
            if not all(np.all(np.isfinite(p.numpy())) for p in parts):
                record["finite"] = False
    record["iterations"] = int(opt.iterations.numpy())
    if kind == "ours":
        record.update(skipped=opt.skipped, overflows=opt.overflows, steps=opt.steps, growths=opt.growths)
    record["weights_equal_across_replicas"] = bool(record["weights_equal_across_replicas"])
    record["replicas"] = strategy.num_replicas_in_sync
    return record


def run_fit(master=False, recipe=None, nan_every_step=False):
    """model.fit under the strategy: a global batch of 8 is split 4 + 4; one sample is inf.

    ``master``: the first layer stores bfloat16 variables with FP32 masters in the optimizer.
    ``recipe``: the optimizer's recipe instead of the ``keras`` preset (``bf16-mixed``: no loss scaling,
    non-finite steps skipped all the same).  ``nan_every_step``: the second replica's loss is NaN on every
    step (the divergence rule must stop the run on both replicas: the result holds its message).
    """
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    rng = np.random.default_rng(0)
    x = rng.normal(size=(48, 3)).astype("float32")
    y = x.sum(axis=1, keepdims=True).astype("float32")
    x[8 * 2 + 5, 1] = np.inf  # batch 2, second half: the second replica's share
    if nan_every_step:
        x.reshape(6, 8, 3)[:, 5, 1] = np.nan
    with strategy.scope():
        keras.utils.set_random_seed(3)
        first = keras.layers.Dense(2, dtype="bfloat16" if master else None)
        model = keras.Sequential([keras.Input((3,)), first, keras.layers.Dense(1)])
        if recipe is None:
            opt = keras_ext.LossScaleOptimizer(keras.optimizers.Adam(0.01), "keras", dynamic_growth_steps=2,
                                               master_weights=master)
        else:
            opt = keras_ext.LossScaleOptimizer(keras.optimizers.Adam(0.01), recipe=recipe, master_weights=master)
        model.compile(opt, "mse")
    error = None
    try:
        model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    except Exception as exc:  # the divergence stop (nan_every_step)
        if not nan_every_step:
            raise
        error = f"{type(exc).__name__}: {exc}"
    equal = finite = True
    for v in model.trainable_variables + [m for m in opt.master_variables if m is not None]:
        parts = strategy.experimental_local_results(v.value)
        equal &= all(np.array_equal(parts[0].numpy(), p.numpy()) for p in parts[1:])
        finite &= all(bool(np.all(np.isfinite(p.numpy()))) for p in parts)
    return {"skipped": opt.skipped, "overflows": opt.overflows, "steps": opt.steps,
            "iterations": int(opt.iterations.numpy()), "weights_equal_across_replicas": bool(equal),
            "finite": bool(finite), "scale": opt.current_scale,
            "masters": sum(m is not None for m in opt.master_variables), "error": error,
            "scaling": opt.scaler_config.enabled}


if __name__ == "__main__":
    kinds = sys.argv[1:] or ["ours"]
    runs = {"fit": run_fit, "fit_master": lambda: run_fit(True), "fit_bf16": lambda: run_fit(recipe="bf16-mixed"),
            "diverge": lambda: run_fit(recipe="bf16-mixed", nan_every_step=True)}
    print("RESULT " + json.dumps({k: runs[k]() if k in runs else run(k) for k in kinds}))
