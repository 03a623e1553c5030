"""Run in a subprocess: bytes a bf16-master Keras model holds between steps and at its peak during a step,
measured by TensorFlow's BFC allocator on the CPU (``TF_CPU_ALLOCATOR_USE_BFC``, set before TF loads).

Prints one JSON line: ``params``, ``held`` (after the third step), ``peak`` (during the fourth), the core's
estimate at the step (``estimate``, with the optimizer's own ``fp32_master_grads``), the bytes kept
between steps (``between``: weights, masters, optimizer state), the largest variable's size.

The third argument: ``copy`` (FP32 masters) or ``remainders`` (``master_remainders=True``: masters as
bf16 + int16 remainder).
"""

import os

os.environ["TF_CPU_ALLOCATOR_USE_BFC"] = "true"
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import gc  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import keras_ext  # noqa: E402
from keras_ext.diagnostics import memory_report  # noqa: E402
from mp_callbacks.recipes import get_recipe  # noqa: E402


def _fp32_built(width: int, depth: int) -> keras.Model:
    x = inp = keras.Input((width,))
    for _ in range(depth):
        x = keras.layers.Dense(width, use_bias=False)(x)
    return keras.Model(inp, keras.layers.Dense(1, use_bias=False, dtype="float32")(x))


def main(width: int, depth: int, mode: str) -> None:
    keras.utils.set_random_seed(0)
    keras_ext.set_global_policy("bf16-master")
    model = keras_ext.apply_policy(_fp32_built(width, depth))  # built with FP32 variables, stored bf16
    gc.collect()  # the FP32 build is garbage (a cycle): not counted as held
    recipe = get_recipe("bf16-master", master_remainders=mode == "remainders")
    opt = keras_ext.master_optimizer(keras.optimizers.Adam(1e-3), recipe)
    model.compile(opt, "mse", jit_compile=False)
    xb, yb = np.ones((4, width), "float32"), np.zeros((4, 1), "float32")
    for _ in range(3):  # the optimizer is built inside the first traced step, as in model.fit
        model.train_on_batch(xb, yb)
    held = tf.config.experimental.get_memory_info("CPU:0")["current"]
    tf.config.experimental.reset_memory_stats("CPU:0")
    model.train_on_batch(xb, yb)
    peak = tf.config.experimental.get_memory_info("CPU:0")["peak"]
    report = memory_report(model, opt)
    est = report["estimate"]
    print(json.dumps({"params": est["params"], "held": held, "peak": peak, "estimate": est["total"],
                      "between": est["weights"] + est["masters"] + est["optimizer_state"],
                      "fp32_master_grads": opt.fp32_master_grads, "actual": report["actual"]["total"],
                      "largest": max(int(np.prod(v.shape)) for v in model.trainable_variables)}))


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
