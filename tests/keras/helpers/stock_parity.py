"""The same fit run with stock Keras' LossScaleOptimizer and with keras_ext's, with overflows
injected at chosen batches (tests/keras/test_optimizer.py compares them).

Importable (:func:`compare`) and runnable (``python -m tests.keras.helpers.stock_parity``
prints one JSON line).
"""

from __future__ import annotations

import json

import keras
import numpy as np
from keras import ops

import keras_ext

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
        if keras.backend.backend() == "jax":  # the JAX trainer writes its state back to the variables on request
            model.jax_state_sync()
        scales.append(float(ops.convert_to_numpy(model.optimizer.dynamic_scale)))
        iters.append(int(ops.convert_to_numpy(model.optimizer.iterations)))

    x, y = make_data()
    model.fit(x, y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0,
              callbacks=[keras.callbacks.LambdaCallback(on_train_batch_end=on_batch_end)])
    out = {
        "scales": scales,
        "iterations": iters,
        "weights": [ops.convert_to_numpy(w).astype("float64").tolist() for w in model.weights],
        "inner_slots": [ops.convert_to_numpy(v).astype("float64").tolist()
                        for v in model.optimizer.inner_optimizer.variables],
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
