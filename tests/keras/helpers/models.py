"""Small models and data for the keras_ext.MixedPrecisionMonitor tests (the Lightning tests' twins)."""

from __future__ import annotations

import keras
import numpy as np
from keras import ops

import keras_ext


@keras.saving.register_keras_serializable(package="keras_ext_tests")
class Amplify(keras.layers.Layer):
    """``x * 1e6 * 1e-6``: identity in FP32, inf in float16 (1e6 is past 65504)."""

    def call(self, x):
        return x * 1e6 * 1e-6


class GradBoost(keras.layers.Layer):
    """Identity forward, gradient times 1e6: overflows only in the backward pass (TensorFlow backend)."""

    def call(self, x):
        import tensorflow as tf

        @tf.custom_gradient
        def boost(t):
            return tf.identity(t), lambda dy: dy * 1e6

        return boost(x)


def regression(steps: int, batch: int = 8, dim: int = 8, inf_steps=(), seed: int = 0):
    """``x, y, sample_weight`` for ``steps`` batches; one inf sample weight on each step of ``inf_steps`` (0-based)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((steps * batch, dim)).astype("float32")
    y = (x @ rng.standard_normal((dim, 1)) + 0.1 * rng.standard_normal((steps * batch, 1))).astype("float32")
    w = np.ones(steps * batch, "float32")
    for k in inf_steps:
        w[k * batch] = np.inf
    return x, y, w


def tiny_regressor(dim: int = 8, hidden: int = 16, middle=None, seed: int = 0) -> keras.Model:
    """Dense -> [middle] -> ReLU -> Dense(1) (a Sequential)."""
    keras.utils.set_random_seed(seed)
    layers = [keras.Input((dim,)), keras.layers.Dense(hidden, name="dense")]
    if middle is not None:
        layers.append(middle)
    layers += [keras.layers.ReLU(name="relu"), keras.layers.Dense(1, name="head")]
    return keras.Sequential(layers)


def compile_scaled(model, scaler, lr: float = 1e-2, optimizer: str = "sgd", master: bool = False, **kwargs):
    """``model.compile`` with a keras_ext.LossScaleOptimizer (``kwargs``: its other arguments)."""
    inner = keras.optimizers.SGD(lr) if optimizer == "sgd" else keras.optimizers.Adam(lr)
    opt = keras_ext.LossScaleOptimizer(inner, scaler, master_weights=master, **kwargs)
    model.compile(opt, "mse", jit_compile=False)
    return opt


def fit(model, monitor, steps: int, inf_steps=(), batch: int = 8, epochs: int = 1, callbacks=(), data=None):
    """``epochs`` epochs of ``steps`` batches (unshuffled)."""
    x, y, w = data if data is not None else regression(steps, batch, inf_steps=inf_steps)
    return model.fit(x, y, sample_weight=w, batch_size=batch, epochs=epochs, shuffle=False, verbose=0,
                     callbacks=[monitor, *callbacks])


class RecordLogs(keras.callbacks.Callback):
    """Keeps a copy of every batch's ``logs`` (placed after the monitor)."""

    def __init__(self):
        super().__init__()
        self.rows = []

    def on_train_batch_end(self, batch, logs=None):
        self.rows.append(dict(logs or {}))


def ones_linear(dim: int = 64, dtype=None) -> keras.Model:
    """``x @ w`` with ``w`` = 1: with inputs of ones and loss ``mean(output)`` every gradient is 1."""
    return keras.Sequential([keras.Input((dim,)),
                             keras.layers.Dense(1, use_bias=False, kernel_initializer="ones", dtype=dtype,
                                                name="lin")])


def mean_output(y_true, y_pred):
    return ops.mean(ops.cast(y_pred, "float32"), axis=-1)


def spread_inputs(dim: int = 17, n: int = 8):
    """One row per batch: ``x_j = 10**(-j/2)``."""
    x = np.tile((10.0 ** (-np.arange(dim) / 2)).astype("float32"), (n, 1))
    return x, np.zeros((n, 1), "float32")
