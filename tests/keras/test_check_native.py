"""The inf/NaN check as one TensorFlow op (``keras_ext.check_native``): ``found_inf`` decides as the generic
``isfinite`` + ``all`` per gradient does, the traced step holds the one op instead of two per gradient, and
what the op cannot take (sparse or float16 gradients, XLA) keeps the generic check."""

import shutil
import warnings

import keras
import numpy as np
import pytest

from keras_ext import check_native
from keras_ext.grad_check import found_inf

pytestmark = [pytest.mark.skipif(keras.backend.backend() != "tensorflow", reason="a TensorFlow op"),
              pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler")]


@pytest.fixture(scope="module")
def tf():
    import tensorflow

    assert check_native.native_check() is not None, "the op did not build or load here"
    return tensorflow


def _grads(tf, special=None, where=(1, 7)):
    rng = np.random.default_rng(0)
    values = [rng.standard_normal(33), rng.standard_normal((8, 130)), rng.standard_normal(5),
              rng.standard_normal(1000)]
    if special is not None:
        values[where[0]].reshape(-1)[where[1]] = special
    dtypes = [tf.float32, tf.bfloat16, tf.float32, tf.bfloat16]
    return [tf.cast(tf.constant(v.astype(np.float32)), d) for v, d in zip(values, dtypes)]


def _generic(tf, grads):
    return not all(bool(tf.reduce_all(tf.math.is_finite(g))) for g in grads)


def _op_types(tf, fn, grads):
    graph = tf.function(fn).get_concrete_function([tf.TensorSpec(g.shape, g.dtype) for g in grads]).graph
    return [op.type for op in graph.get_operations()]


@pytest.mark.parametrize("special", [None, np.inf, -np.inf, np.nan, 3e38, 1e-40, -0.0])
@pytest.mark.parametrize("where", [(0, 0), (1, 1039), (2, 4), (3, 999)])
def test_found_inf_decides_as_isfinite(tf, special, where):
    grads = _grads(tf, special, where)
    assert bool(found_inf(grads)) == _generic(tf, grads)
    assert bool(found_inf([None, *grads])) == _generic(tf, grads)  # variables without a gradient
    assert not bool(found_inf([]))


def test_the_traced_check_is_one_op(tf):
    types = _op_types(tf, lambda gs: found_inf(gs), _grads(tf))
    assert types.count("MpAnyNonfinite") == 1 and "IsFinite" not in types


def test_what_the_op_cannot_take_keeps_the_generic_check(tf):
    grads = _grads(tf, np.inf, (0, 3))
    half = [*grads[:3], tf.constant([1.0, np.inf], tf.float16)]
    assert bool(found_inf(half)) and "MpAnyNonfinite" not in _op_types(tf, lambda gs: found_inf(gs), half)
    sparse = tf.IndexedSlices(tf.constant([[1.0, np.nan]]), tf.constant([0]), tf.constant([3, 2]))
    assert bool(found_inf([grads[1], sparse]))
    xla = tf.function(lambda gs: found_inf(gs), jit_compile=True)
    specs = [tf.TensorSpec(g.shape, g.dtype) for g in grads]
    graph = xla.get_concrete_function(specs).graph
    assert "MpAnyNonfinite" not in [op.type for op in graph.get_operations()]
    assert bool(xla(grads)) and not bool(xla(_grads(tf)))


def test_a_first_call_inside_a_trace_loads_and_checks_it_eagerly(tf):
    check_native._loaded.cache_clear()
    try:
        assert "MpAnyNonfinite" in _op_types(tf, lambda gs: found_inf(gs), _grads(tf))
        assert check_native.native_check() is not None
    finally:
        check_native._loaded.cache_clear()


def test_off_with_the_switch(tf, monkeypatch):
    monkeypatch.setattr(check_native, "NATIVE", False)
    assert check_native.native_check() is None
    assert "MpAnyNonfinite" not in _op_types(tf, lambda gs: found_inf(gs), _grads(tf))


def test_a_failed_build_warns_once_and_the_generic_check_decides(tf, monkeypatch):
    def fail():
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(check_native, "_build", fail)
    check_native._loaded.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match="no compiler here"):
            assert check_native.native_check() is None
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert check_native.native_check() is None  # once
            assert bool(found_inf(_grads(tf, np.nan)))
    finally:
        check_native._loaded.cache_clear()  # the next caller loads the real one again
