"""``fp8-mixed`` at a finer granularity in Keras (``get_recipe("fp8-mixed", fp8={"granularity": ...})``).

* The ``keras.ops`` cast (keras_ext.fp8.blocks) equals the core's NumPy reference for every kind, format,
  axis and rounding (inputs without float32 subnormals, which TensorFlow flushes to zero).
* One FP8 Dense / EinsumDense: output and both gradients equal the NumPy model in which every matmul
  casts its operands along its own contraction axis (the model of tests/lightning/test_fp8_granularity.py,
  in Keras's kernel layout); ``weight_grad_hp`` keeps the kernel gradient exact.
* Training: every kind trains the MLP with attention, a non-finite batch is skipped, an EinsumDense of
  another form is refused by name.
"""

from __future__ import annotations

import numpy as np
import pytest

keras = pytest.importorskip("keras")
from keras import ops  # noqa: E402

import keras_ext  # noqa: E402
from keras_ext.fp8 import block_qdq, contracted_axes  # noqa: E402
from mp_callbacks.fp8 import FP8Granularity, block_shape, dequantize, quantize  # noqa: E402
from tests.keras.test_fp8 import build_mlp, data, fit_steps  # noqa: E402

KINDS = ("rowwise", "blockwise", "mxfp8")
E4, E5 = "float8_e4m3fn", "float8_e5m2"


def reference_qdq(x: np.ndarray, kind: str, fmt: str, axis: int, weight: bool = False, **settings) -> np.ndarray:
    """The core's cast read back as the adapters read it: ``q * (1 / s)`` (MX: ``q * 2**(e - 127)``)."""
    q, s = quantize(x, kind, fmt, axis=axis, weight=weight, **settings)
    if kind == "mxfp8":
        return dequantize(q, s, kind, axis=axis, weight=weight)
    inv = np.moveaxis((np.float32(1) / s).astype(np.float32), axis, -1)
    full = _full(inv, np.moveaxis(q, axis, -1).shape, kind, weight)
    return (q * np.moveaxis(full, -1, axis)).astype(np.float32)


def _full(values: np.ndarray, shape: tuple[int, ...], kind: str, weight: bool) -> np.ndarray:
    """One value per block (contraction axis last) repeated to ``shape``."""
    blocks = block_shape(kind, len(shape), weight=weight)
    for axis, (n, b) in enumerate(zip(shape, blocks)):
        if b > 1:
            values = np.repeat(values, min(b, n), axis=axis)
    return np.broadcast_to(values[tuple(slice(0, n) for n in shape)], shape)


def cases() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    wide = (rng.standard_normal((8, 96)) * np.exp(rng.uniform(-12, 12, (8, 1)))).astype(np.float32)
    zeros = rng.standard_normal((8, 96)).astype(np.float32)
    zeros[0] = 0.0
    zeros[2, 7] = 3e4
    odd = rng.standard_normal((130, 300)).astype(np.float32)
    return {"wide": wide, "zeros_outlier": zeros, "odd": odd}


@pytest.mark.parametrize("settings", [{}, {"mx_rounding": "rceil"}, {"pow2_scales": False}], ids=str)
@pytest.mark.parametrize("kind", KINDS)
def test_the_keras_cast_is_the_core_reference(kind, settings):
    g = FP8Granularity(kind, **settings)
    for x in cases().values():
        for axis in (-1, 0):
            for weight in (False, True):
                for fmt in (E4, E5):
                    got = ops.convert_to_numpy(block_qdq(x, g, fmt, axis=axis, weight=weight)[0])
                    want = reference_qdq(x, kind, fmt, axis, weight, pow2_scales=g.rounds_to_pow2,
                                         mx_rounding=g.mx_rounding)
                    assert np.array_equal(got, want), (kind, axis, weight, fmt)


def test_einsum_forms():
    assert contracted_axes("abc,cd->abd") == 1
    assert contracted_axes("abc,cde->abde") == 1
    assert contracted_axes("abcd,cde->abe") == 2
    assert contracted_axes("ab,bc->ac") == 1
    assert contracted_axes("abc,dc->abd") is None  # the kernel's contracted axis is not leading


def _tape_grads(layer, x, dy):
    import tensorflow as tf

    xt = tf.convert_to_tensor(x)
    with tf.GradientTape() as tape:
        tape.watch(xt)
        y = layer(xt, training=True)
        loss = tf.reduce_sum(tf.cast(y, tf.float32) * dy)
    dx, dk = tape.gradient(loss, [xt, layer.kernel])
    return np.asarray(y, np.float32), np.asarray(dx), np.asarray(dk)


@pytest.mark.skipif(keras.backend.backend() != "tensorflow", reason="the gradients are taken with a TF tape")
@pytest.mark.parametrize("weight_grad_hp", [False, True])
@pytest.mark.parametrize("kind", KINDS)
def test_one_dense_casts_each_operand_along_its_contraction(kind, weight_grad_hp):
    recipe = keras_ext_recipe({"granularity": {"kind": kind, "weight_grad_hp": weight_grad_hp}})
    keras_ext.set_global_policy("32-true")
    keras.utils.set_random_seed(0)
    layer = keras.layers.Dense(48, use_bias=False)
    layer.build((None, 160))
    from keras_ext.fp8 import enable_fp8

    enable_fp8(layer, recipe.fp8)
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((140, 160)) * np.exp(rng.standard_normal((1, 160)) * 2)).astype(np.float32)
    dy = (rng.standard_normal((140, 48)) * 1e-3).astype(np.float32)
    y, dx, dk = _tape_grads(layer, x, dy)
    k = np.asarray(layer.kernel, np.float32)
    want_y = reference_qdq(x, kind, E4, -1) @ reference_qdq(k, kind, E4, 0, weight=True)
    want_dx = reference_qdq(dy, kind, E5, -1) @ reference_qdq(k, kind, E4, 1, weight=True).T
    want_dk = x.T @ dy if weight_grad_hp else reference_qdq(x, kind, E4, 0).T @ reference_qdq(dy, kind, E5, 0)
    for name, got, want in (("y", y, want_y), ("dx", dx, want_dx), ("dk", dk, want_dk)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max(), err_msg=name)


def keras_ext_recipe(fp8):
    from mp_callbacks.recipes import get_recipe

    return get_recipe("fp8-mixed", fp8=fp8)


@pytest.mark.parametrize("kind", KINDS)
def test_every_kind_trains_and_skips_a_non_finite_batch(kind):
    """mxfp8 with attention too: MultiHeadAttention's EinsumDense projections contract one axis (q, k, v)
    and two (the output)."""
    model = build_mlp(fp8={"granularity": kind}, attention=kind == "mxfp8")
    x, y = data(n=32)
    optimizer, seen = fit_steps(model, x, y, 4, bad={1})
    assert (optimizer.overflows, optimizer.skipped) == (1, 1)
    assert all(np.array_equal(a, b) for a, b in zip(seen[1]["before"], seen[2]["before"]))  # nothing applied
    assert not all(np.array_equal(a, b) for a, b in zip(seen[2]["before"], seen[3]["before"]))  # this one was
    assert np.isfinite(ops.convert_to_numpy(model(x[:8]))).all()
    keras_ext.set_global_policy("32-true")


def test_an_einsum_of_another_form_is_refused_by_name():
    recipe = keras_ext_recipe({"granularity": "rowwise"})
    keras_ext.set_global_policy(recipe)
    try:
        inp = keras.Input((4, 6))
        h = keras.layers.EinsumDense("abc,dc->abd", output_shape=(4, 5), name="odd")(inp)
        out = keras.layers.Dense(1, name="head")(h)  # the output layer stays FP32: "odd" is an FP8 candidate
        model = keras_ext.apply_policy(keras.Model(inp, out), recipe)
        with pytest.raises(NotImplementedError, match="layer 'odd' has 'abc,dc->abd'"):
            model(np.ones((2, 4, 6), np.float32), training=True)
    finally:
        keras_ext.set_global_policy("32-true")
