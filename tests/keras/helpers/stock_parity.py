"""Shared by the parity tests: the same fit run with stock Keras' LossScaleOptimizer
and with keras_ext's, with overflows injected at chosen batches.

Importable (the TensorFlow test calls :func:`compare` in-process) and runnable
(``python parity_script.py`` prints one JSON line; the torch test runs it with
``KERAS_BACKEND=torch`` in a fresh process, since the backend is fixed at import).
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import keras  # noqa: E402
from keras import ops  # noqa: E402

import keras_ext  # noqa: E402

BATCH = 4
BAD_BATCHES = (2, 3, 9, 13)  # a sample of 1e20 makes the scaled loss and gradients inf
GROWTH = 3


def make_data(n: int = 64):
    """Linear-regression data; the first sample of each bad batch is huge."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 4)).astype("float32")
    y = (x @ np.array([[1.0], [-2.0], [0.5], [3.0]], dtype="float32")).astype("float32")
    for b in BAD_BATCHES:
        x[b * BATCH] = 1e20
    return x, y


def run(kind: str, epochs: int = 1, jit_compile: bool = False):
    """Fit a tiny MLP with ``kind`` in {"stock", "ours"}; return scales, weights, counters."""
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dense(1)])
    inner = keras.optimizers.Adam(1e-2)
    if kind == "stock":
        opt = keras.optimizers.LossScaleOptimizer(inner, dynamic_growth_steps=GROWTH)
    else:
        opt = keras_ext.LossScaleOptimizer(inner, "keras", dynamic_growth_steps=GROWTH)
    model.compile(opt, "mse", jit_compile=jit_compile)
    scales: list[float] = []
    iters: list[int] = []

    def on_batch_end(batch, logs=None):
        scales.append(float(ops.convert_to_numpy(model.optimizer.dynamic_scale)))
        iters.append(int(ops.convert_to_numpy(model.optimizer.iterations)))

    x, y = make_data()
    model.fit(x, y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0,
              callbacks=[keras.callbacks.LambdaCallback(on_train_batch_end=on_batch_end)])
    out = {
        "scales": scales,
        "iterations": iters,
        "weights": [ops.convert_to_numpy(w).astype("float64").tolist() for w in model.weights],
        "inner_slots": [ops.convert_to_numpy(v).astype("float64").tolist() for v in model.optimizer.inner_optimizer.variables],
    }
    if kind == "ours":
        o = model.optimizer
        out["counters"] = {"steps": o.steps, "overflows": o.overflows, "skipped": o.skipped, "growths": o.growths}
    return out


def compare(jit_compile: bool = False):
    """Both runs, as plain data."""
    return {"backend": keras.backend.backend(), "stock": run("stock"), "ours": run("ours", jit_compile=jit_compile)}


if __name__ == "__main__":
    print("RESULT " + json.dumps(compare()))
