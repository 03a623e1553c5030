"""Reduced form of the JAX block of docs/guides/scaling-out.md.

There: one process per host, ``jax.distributed.initialize`` first.  Here: one process with 2 host
devices (``--xla_force_host_platform_device_count=2``), the same ``DataParallel`` distribution,
compile (``16-master``) and fit, so the jitted SPMD step and its finite check on the globally
reduced gradient run.  ``tests/keras/test_jax_backend.py`` checks it against one device."""

import os

os.environ["KERAS_BACKEND"] = "jax"
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"

import jax  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_ext  # noqa: E402

assert keras.backend.backend() == "jax" and len(jax.devices()) == 2
# the block: jax.distributed.initialize(coordinator_address=..., num_processes=2, process_id=RANK)
keras.distribution.set_distribution(keras.distribution.DataParallel())   # every device of every process


def build_model():
    return keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(1)])


loss = "mse"
rng = np.random.default_rng(0)
x, y = rng.normal(size=(64, 8)).astype("float32"), rng.normal(size=(64, 1)).astype("float32")
keras_ext.set_global_policy("16-master")
model = keras_ext.apply_policy(build_model())
model.compile(keras_ext.LossScaleOptimizer(keras.optimizers.AdamW(1e-3), recipe="16-master"), loss)
model.fit(x, y, batch_size=16, epochs=1, verbose=0)
opt = model.optimizer   # 4 steps taken; an overflow at the first scale (random init) is skipped, not applied
assert opt.steps == 4 and int(opt.iterations) + opt.skipped == 4, (opt.steps, int(opt.iterations), opt.skipped)
print("keras JAX DataParallel reduced form: OK")
