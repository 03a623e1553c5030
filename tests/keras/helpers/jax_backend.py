"""Run by tests/keras/test_jax_backend.py with ``KERAS_BACKEND=jax`` and 2 host devices
(``XLA_FLAGS=--xla_force_host_platform_device_count=2``): ``python -m tests.keras.helpers.jax_backend OUT.json``.

* ``parity``: :func:`tests.keras.helpers.stock_parity.compare` on JAX: ``model.fit`` with stock Keras'
  ``LossScaleOptimizer`` and with ours (Keras' JAX trainer: ``stateless_apply`` inside ``jit``);
* ``single`` / ``data_parallel``: ``model.fit`` with ``16-master`` (bf16 variables, FP32 masters) and a
  ``MixedPrecisionMonitor`` on one device and under ``keras.distribution.DataParallel`` over the 2 devices;
  one sample of batch 2 is inf (on the second device's half of the batch);
* ``monitor`` / ``divergence``: :mod:`tests.keras.helpers.cross_backend`'s runs (the test runs them on
  TensorFlow too and compares).
"""

import json
import os
import sys

os.environ.setdefault("KERAS_BACKEND", "jax")
import jax  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402
from keras import ops  # noqa: E402

import keras_ext  # noqa: E402
from tests.keras.helpers import cross_backend, stock_parity  # noqa: E402

BATCH = 8


def fit(distributed: bool) -> dict:
    if distributed:
        keras.distribution.set_distribution(keras.distribution.DataParallel(devices=jax.devices()))
    try:
        rng = np.random.default_rng(0)
        x = rng.normal(size=(6 * BATCH, 3)).astype("float32")
        y = x.sum(axis=1, keepdims=True).astype("float32")
        x[2 * BATCH + 5, 1] = np.inf  # batch 2, the second device's half
        keras.utils.set_random_seed(3)
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, dtype="bfloat16"), keras.layers.Dense(1)])
        opt = keras_ext.LossScaleOptimizer(keras.optimizers.Adam(0.01), recipe="16-master", dynamic_growth_steps=2)
        model.compile(opt, "mse")
        scales = []

        def on_batch_end(batch, logs=None):
            model.jax_state_sync()
            scales.append(opt.current_scale)

        monitor = keras_ext.MixedPrecisionMonitor(log_every_n_steps=2, log_memory=False)
        model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
                  callbacks=[monitor, keras.callbacks.LambdaCallback(on_train_batch_end=on_batch_end)])
        sharding = str(model.trainable_variables[0].value.sharding)
        return {"scales": scales, "skipped": opt.skipped, "overflows": opt.overflows, "steps": opt.steps,
                "iterations": int(ops.convert_to_numpy(opt.iterations)),
                "weights": [ops.convert_to_numpy(ops.cast(v, "float32")).tolist() for v in model.trainable_variables],
                "masters": [ops.convert_to_numpy(m).tolist() for m in opt.master_variables if m is not None],
                "dtypes": [keras.backend.standardize_dtype(v.dtype) for v in model.trainable_variables],
                "sharding": sharding,
                "monitor": [[s.step, s.overflow, s.scale, s.skipped_total, s.grad_norm is not None]
                            for s in monitor.history]}
    finally:
        keras.distribution.set_distribution(None)


if __name__ == "__main__":
    out = {"backend": keras.backend.backend(), "devices": len(jax.devices()), "parity": stock_parity.compare(),
           "single": fit(False), "data_parallel": fit(True), "monitor": cross_backend.monitor_run(),
           "divergence": cross_backend.divergence_runs()}
    with open(sys.argv[1], "w") as f:
        json.dump(out, f)
