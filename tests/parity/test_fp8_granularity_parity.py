"""FP8 granularity in Lightning and Keras: the same FP8 matmul, per granularity.

One FP8 matmul with the same FP32 weights (torch ``Linear`` weight ``W``, Keras ``Dense`` kernel ``W^T``),
the same input and the same output gradient, under ``fp8-mixed`` with rowwise, blockwise and MXFP8 scales:
the output and both gradients agree within float32 summation order (the FP8 operands are identical: both
casts are the core's reference bit for bit).
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
keras = pytest.importorskip("keras")
pytestmark = pytest.mark.skipif(keras.backend.backend() != "tensorflow", reason="the Keras side uses a TF tape")

KINDS = ("rowwise", "blockwise", "mxfp8")


def operands(seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((150, 160)) * np.exp(rng.standard_normal((1, 160)) * 2)).astype(np.float32)
    w = (rng.standard_normal((48, 160)) * 0.1).astype(np.float32)
    dy = (rng.standard_normal((150, 48)) * 1e-3).astype(np.float32)
    return x, w, dy


def lightning_side(kind: str, x: np.ndarray, w: np.ndarray, dy: np.ndarray) -> dict[str, np.ndarray]:
    from torch import nn

    from lightning_ext.fp8 import TorchFP8
    from mp_callbacks.recipes import get_recipe

    recipe = get_recipe("fp8-mixed", fp8={"granularity": kind})
    linear = nn.Linear(160, 48, bias=False)
    with torch.no_grad():
        linear.weight.copy_(torch.from_numpy(w))
    fp8 = TorchFP8(recipe.fp8)
    fp8.install(nn.Sequential(linear), recipe.policy)
    xt = torch.from_numpy(x).requires_grad_()
    y = linear(xt)
    y.backward(torch.from_numpy(dy))
    return {"y": y.detach().numpy(), "dx": xt.grad.numpy(), "dw": linear.weight.grad.numpy()}


def keras_side(kind: str, x: np.ndarray, w: np.ndarray, dy: np.ndarray) -> dict[str, np.ndarray]:
    import tensorflow as tf

    import keras_ext
    from keras_ext.fp8 import enable_fp8
    from mp_callbacks.recipes import get_recipe

    recipe = get_recipe("fp8-mixed", fp8={"granularity": kind})
    keras_ext.set_global_policy("32-true")
    layer = keras.layers.Dense(48, use_bias=False)
    layer.build((None, 160))
    layer.kernel.assign(w.T)
    enable_fp8(layer, recipe.fp8)
    xt = tf.convert_to_tensor(x)
    with tf.GradientTape() as tape:
        tape.watch(xt)
        y = layer(xt, training=True)
        loss = tf.reduce_sum(y * dy)
    dx, dk = tape.gradient(loss, [xt, layer.kernel])
    return {"y": np.asarray(y), "dx": np.asarray(dx), "dw": np.asarray(dk).T}


@pytest.mark.parametrize("kind", KINDS)
def test_one_fp8_matmul_is_the_same_in_both_frameworks(kind):
    x, w, dy = operands()
    a, b = lightning_side(kind, x, w, dy), keras_side(kind, x, w, dy)
    for name in ("y", "dx", "dw"):
        scale = np.abs(a[name]).max()
        np.testing.assert_allclose(a[name], b[name], rtol=1e-5, atol=1e-5 * scale, err_msg=f"{kind} {name}")
