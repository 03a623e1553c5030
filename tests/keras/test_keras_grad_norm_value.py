"""The value of ``mp/grad_norm`` (unscaled global L2 norm of the gradients) in Keras, against NumPy.

The reference is the exact gradient, in float64 NumPy, of the same loss (MSE, Keras'
``sum_over_batch_size`` reduction) on the same batch at the weights the step's forward used
(read by a callback in ``on_train_batch_begin``; under ``*-master`` the low-precision model
variables), by a hand-written backward of Dense -> ReLU -> Dense.

Tolerance (dtype-derived): the recipe's compute dtype rounds every dot product of the forward
and backward passes; their lengths along the path sum to ``K = DIM + HIDDEN + BATCH + 8``
(plus input, weight, output and loss roundings), so the logged norm may differ from the exact one
by ``K * u`` relative, ``u`` the compute dtype's unit roundoff (``32-true``: ~2.4e-6, tight
enough that the norm of a neighbouring step's gradients is far outside it).  A scaled norm (off by
the loss scale, 2**8 here) is far outside every bound.  TensorFlow float16 is slow on CPU: the
model and the batches are tiny.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

keras = pytest.importorskip("keras")
from keras import ops  # noqa: E402

import keras_ext  # noqa: E402

DIM, HIDDEN, BATCH, STEPS = 8, 16, 8, 6
INF_STEP = 2  # 0-based step with an inf sample weight: an overflow, skipped by every recipe
COMPUTE = {"32-true": np.float32, "16-mixed": np.float16, "bf16-mixed": "bfloat16",
           "16-master": np.float16, "bf16-master": "bfloat16"}
UNIT = {"32-true": 2.0**-24, "16-mixed": 2.0**-11, "bf16-mixed": 2.0**-8, "16-master": 2.0**-11,
        "bf16-master": 2.0**-8}  # unit roundoff of the compute dtype


def _data(inf_step: int):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((STEPS * BATCH, DIM)).astype("float32")
    y = (x @ rng.standard_normal((DIM, 1)) + 0.1 * rng.standard_normal((STEPS * BATCH, 1))).astype("float32")
    w = np.ones(STEPS * BATCH, "float32")
    w[inf_step * BATCH] = np.inf
    return x, y, w


class WeightsBeforeStep(keras.callbacks.Callback):
    """The model's weights (float64 copies) as each step's forward sees them."""

    def __init__(self):
        super().__init__()
        self.weights = []

    def on_train_batch_begin(self, batch, logs=None):
        dense, head = self.model.get_layer("dense"), self.model.get_layer("head")
        self.weights.append([np.asarray(ops.convert_to_numpy(v)).astype(np.float64)
                             for v in (dense.kernel, dense.bias, head.kernel, head.bias)])


def exact_grads(weights, x, y):
    """d/dparams of mean((relu(x K1 + b1) K2 + b2 - y)^2), float64."""
    k1, b1, k2, b2 = weights
    h = x @ k1 + b1
    r = np.maximum(h, 0.0)
    out = r @ k2 + b2
    dout = 2.0 * (out - y) / out.size
    dk2, db2 = r.T @ dout, dout.sum(axis=0)
    dh = (dout @ k2.T) * (h > 0)
    return [x.T @ dh, dh.sum(axis=0), dk2, db2]


def norm(arrays) -> float:
    return math.sqrt(sum(float(np.sum(np.square(a))) for a in arrays))


@pytest.mark.parametrize("recipe", list(COMPUTE))
def test_logged_grad_norm_is_the_unscaled_global_l2_norm(recipe):
    fp16 = COMPUTE[recipe] is np.float16
    keras.utils.set_random_seed(0)
    keras_ext.set_global_policy(recipe)
    model = keras_ext.apply_policy(keras.Sequential([
        keras.Input((DIM,)), keras.layers.Dense(HIDDEN, name="dense"), keras.layers.ReLU(name="relu"),
        keras.layers.Dense(1, name="head")]))
    opt = keras_ext.master_optimizer(keras.optimizers.SGD(0.05), recipe,
                                     scaler={"init_scale": 2.0**8} if fp16 else None)
    model.compile(opt, "mse", jit_compile=False)
    monitor = keras_ext.MixedPrecisionMonitor(log_every_n_steps=1, log_memory=False)
    before = WeightsBeforeStep()
    x, y, w = _data(INF_STEP)
    model.fit(x, y, sample_weight=w, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
              callbacks=[monitor, before])

    records = list(monitor.history)
    assert [r.step for r in records] == list(range(1, STEPS + 1))
    assert len(before.weights) == STEPS
    bound = (DIM + HIDDEN + BATCH + 8) * UNIT[recipe]
    norms = []
    for k, record in enumerate(records):
        if k == INF_STEP:  # the overflow step: its unscaled gradients are not finite
            assert record.overflow and record.grad_norm is not None and not math.isfinite(record.grad_norm)
            continue
        assert not record.overflow, k
        xb, yb = x[k * BATCH:(k + 1) * BATCH].astype(np.float64), y[k * BATCH:(k + 1) * BATCH].astype(np.float64)
        exact = norm(exact_grads(before.weights[k], xb, yb))
        assert record.grad_norm == pytest.approx(exact, rel=bound, abs=0), (recipe, k, record.grad_norm, exact)
        norms.append(record.grad_norm)
    assert len(norms) == STEPS - 1 and opt.skipped == 1
    if recipe == "32-true":  # neighbouring steps' norms are told apart by the bound
        assert min(abs(a - b) / b for a, b in zip(norms, norms[1:])) > 2 * bound
