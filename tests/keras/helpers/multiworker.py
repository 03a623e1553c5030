"""One worker of the 2-worker ``MultiWorkerMirroredStrategy`` test (tests/keras/test_multiworker.py):
``python -m tests.keras.helpers.multiworker OUT_DIR`` with ``TF_CONFIG`` set by the test.

Each worker trains the same tiny model with ``keras_ext.LossScaleOptimizer`` in a custom loop on
its own batches; only worker 1's batch holds an inf at ``BAD_STEPS``.  It writes ``worker<i>.json``:

* ``uninterrupted``: the scale after each step, the counters, the final weights and optimizer slots;
* ``resumed``: the ``.keras`` file that run saved after ``SAVE_AT`` steps, loaded under the strategy and
  continued (must equal ``uninterrupted``);
* ``reference``: no strategy, one process: the optimizer gets the sum of both workers' gradients
  (what the all-reduce computes), on the same batches;
* ``comm_bf16``: the run again with ``comm_dtype="bfloat16"`` and the dtypes/bytes each step hands to
  the cross-worker all-reduce (counted at trace time, one trace = one step);
* ``comm_fp16_big`` / ``reference_big``: at ``BIG_STEP`` worker 0's gradients are finite in FP32 but
  overflow float16: with ``comm_dtype="float16"`` the reduced gradients are inf, both workers skip;
* ``fit`` / ``reference_fit``: ``model.fit`` (``keras_ext.distributed.multi_worker_fit``) on the same
  batches with the inf in worker 0's batch instead, and what ``keras_ext.distributed.CommCounter`` counted;
  the one-process run on the summed gradients of those batches.
"""

import json
import os
import sys

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)
STRATEGY = tf.distribute.MultiWorkerMirroredStrategy()  # before any other TF op (reads TF_CONFIG)

import keras  # noqa: E402

import keras_ext  # noqa: E402
from keras_ext.distributed import CommCounter, multi_worker_fit  # noqa: E402
from mp_callbacks import get_recipe  # noqa: E402
from tests.keras.helpers.comm_count import ReduceCounter  # noqa: E402

BAD_STEPS = {1, 4}
STEPS = 6
SAVE_AT = 3
BIG_STEP = 2  # big=True: worker 0's gradients are finite in FP32 but beyond float16's range
WORKERS = 2


def batch(step, worker, big=False, bad_worker=1):
    rng = np.random.default_rng(100 * step + worker)
    x = rng.normal(size=(4, 3)).astype("float32") * (300.0 if big and worker == 0 and step == BIG_STEP else 1.0)
    y = x.sum(axis=1, keepdims=True).astype("float32")
    if worker == bad_worker and step in BAD_STEPS:
        x[0, 0] = np.inf
    return x, y


def build(recipe=None):
    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2), keras.layers.Dense(1)])
    opt = keras_ext.LossScaleOptimizer(keras.optimizers.Adam(0.01), "keras", dynamic_growth_steps=2, recipe=recipe)
    model.compile(opt, "mse")
    opt.build(model.trainable_variables)
    return model, opt


def loss_fn(model, x, y):
    return tf.reduce_mean(tf.square(model(x, training=True) - y)) / WORKERS


def make_step(model, opt):
    @tf.function
    def train_step(x, y):
        def step(x, y):
            with tf.GradientTape() as tape:
                scaled = opt.scale_loss(loss_fn(model, x, y))
            opt.apply(tape.gradient(scaled, model.trainable_variables), model.trainable_variables)

        STRATEGY.run(step, args=(x, y))

    return train_step


def state(model, opt):
    return {"weights": [np.asarray(v.numpy()).tolist() for v in model.trainable_variables],
            "slots": [np.asarray(v.numpy()).tolist() for v in opt.inner_optimizer.variables],
            "skipped": opt.skipped, "overflows": opt.overflows, "steps": opt.steps,
            "iterations": int(opt.iterations.numpy()), "scale": opt.current_scale}


def train(model, opt, worker, steps, scales, big=False, train_step=None):
    train_step = train_step or make_step(model, opt)
    for s in steps:
        x, y = batch(s, worker, big)
        train_step(tf.constant(x), tf.constant(y))
        scales.append(opt.current_scale)


def distributed(worker, out_dir):
    out = {}
    with STRATEGY.scope():
        model, opt = build()
    scales, train_step = [], make_step(model, opt)
    train(model, opt, worker, range(SAVE_AT), scales, train_step=train_step)
    path = os.path.join(out_dir, f"w{worker}.keras")  # every worker writes (its own path)
    model.save(path)  # reads the variables only: the run goes on uninterrupted
    train(model, opt, worker, range(SAVE_AT, STEPS), scales, train_step=train_step)
    out["uninterrupted"] = dict(state(model, opt), scales=scales)

    with STRATEGY.scope():
        model = keras.models.load_model(path, safe_mode=True)
    opt, scales = model.optimizer, scales[:SAVE_AT]
    train(model, opt, worker, range(SAVE_AT, STEPS), scales)
    out["resumed"] = dict(state(model, opt), scales=scales, optimizer=type(opt).__name__)

    with STRATEGY.scope():
        model, opt = build(get_recipe("16-mixed", comm_dtype="bfloat16"))
    scales = []
    with ReduceCounter() as counter:
        train(model, opt, worker, range(STEPS), scales)
    out["comm_bf16"] = dict(state(model, opt), scales=scales, reduced=counter.per_trace())

    with STRATEGY.scope():
        model, opt = build(get_recipe("16-mixed", comm_dtype="float16"))
    scales = []
    train(model, opt, worker, range(STEPS), scales, big=True)
    out["comm_fp16_big"] = dict(state(model, opt), scales=scales)
    return out


class Scales(keras.callbacks.Callback):
    """The scale after each step of ``model.fit``."""

    def __init__(self, scales):
        super().__init__()
        self.scales = scales

    def on_train_batch_end(self, batch, logs=None):
        self.scales.append(self.model.optimizer.current_scale)


def fit_run(worker):
    """``model.fit`` under the strategy on per-worker batches (``distribute_datasets_from_function``:
    worker i reads ``batch(step, i)``); the inf is in worker 0's batch this time."""
    with STRATEGY.scope():
        model, opt = build()
    multi_worker_fit(model)  # Keras 3's fit fails under MultiWorkerMirroredStrategy without it

    def dataset_fn(ctx):
        xs, ys = zip(*(batch(s, ctx.input_pipeline_id, bad_worker=0) for s in range(STEPS)))
        return tf.data.Dataset.from_tensor_slices((np.stack(xs), np.stack(ys)))  # one element = one batch of 4

    scales = []
    with CommCounter() as counter:  # what the (one) traced step hands to the all-reduce
        model.fit(STRATEGY.distribute_datasets_from_function(dataset_fn), epochs=1, steps_per_epoch=STEPS,
                  verbose=0, callbacks=[Scales(scales)])
    comm = {kind: [[list(v) for v in values] for k, values in counter.calls if k == kind]
            for kind in ("gradients", "other")}
    return dict(state(model, opt), scales=scales, comm=comm, grad_bytes=counter.bytes_of("gradients"))


def reference(big=False, bad_worker=1):
    model, opt = build()
    scales = []
    variables = model.trainable_variables

    @tf.function
    def grads_of(x, y):
        with tf.GradientTape() as tape:
            scaled = opt.scale_loss(loss_fn(model, x, y))
        return tape.gradient(scaled, variables)

    for s in range(STEPS):
        per_worker = [grads_of(*map(tf.constant, batch(s, w, big, bad_worker))) for w in range(WORKERS)]
        opt.apply([a + b for a, b in zip(*per_worker)], variables)
        scales.append(opt.current_scale)
    return dict(state(model, opt), scales=scales)


if __name__ == "__main__":
    out_dir = sys.argv[1]
    worker = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    result = distributed(worker, out_dir)
    result["fit"] = fit_run(worker)
    result["reference_fit"] = reference(bad_worker=0)
    result["reference"] = reference()
    result["reference_big"] = reference(big=True)
    result["replicas"] = STRATEGY.num_replicas_in_sync
    with open(os.path.join(out_dir, f"worker{worker}.json"), "w") as f:
        json.dump(result, f)
