"""``*-master``'s update as one TensorFlow op (``keras_ext.master_native``): the traced step of ``bf16-master``
steps masters, moments and bf16 variables with ``MpMasterAdam`` and gets the bits of Keras' own update traced in
the step's graph (``fuse_masters`` off, the op off); a skipped step writes nothing; what the op cannot take keeps
Keras' update; a kernel that differs from Keras fails its load check."""

import shutil
import warnings

import keras
import numpy as np
import pytest

import keras_ext
from keras_ext import master_native

pytestmark = [pytest.mark.skipif(keras.backend.backend() != "tensorflow", reason="a TensorFlow op"),
              pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler")]


@pytest.fixture(scope="module")
def tf():
    import tensorflow

    assert master_native.native_master_adam() is not None, "the op did not build or load here"
    return tensorflow


@pytest.fixture
def traced(monkeypatch):
    """How many variables each ``MpMasterAdam`` traced so far took (one entry per traced op)."""
    calls: list[int] = []
    step = master_native.NativeMasterAdam.step

    def counted(self, optimizer, grads, targets, *args, **kwargs):
        calls.append(len(targets))
        return step(self, optimizer, grads, targets, *args, **kwargs)

    monkeypatch.setattr(master_native.NativeMasterAdam, "step", counted)
    return calls


def _fit(make_inner, native=True, scaler=None, steps=6, batches=None, compile_kw=None, recipe="bf16-master",
         embedding=False):
    """A small model (Dense, LayerNormalization kept FP32, Dense; ``embedding``: an Embedding first, whose
    gradient is an ``IndexedSlices``) fitted ``steps`` steps under ``recipe``; returns the model, the optimizer
    and every variable's value (model, then optimizer)."""
    keras.utils.set_random_seed(0)
    keras_ext.set_global_policy(recipe)
    try:
        head = [keras.Input((3,), dtype="int32"), keras.layers.Embedding(11, 8), keras.layers.Flatten()] \
            if embedding else [keras.Input((8,))]
        model = keras.Sequential([*head, keras.layers.Dense(16, activation="gelu"),
                                  keras.layers.LayerNormalization(), keras.layers.Dense(4)])
        model = keras_ext.apply_policy(model, keras_ext.get_global_recipe().policy)
    finally:
        keras.config.set_dtype_policy("float32")
    opt = keras_ext.master_optimizer(make_inner(), recipe, **({"scaler": scaler} if scaler else {}))
    if not native:  # Keras' update in the step's graph: the op off, XLA off
        opt.fuse_masters = False
        opt._native_update = lambda: None
    model.compile(opt, loss="mse", **{"jit_compile": False, **(compile_kw or {})})
    rng = np.random.default_rng(1)
    x = rng.integers(0, 11, (4 * steps, 3)).astype("int32") if embedding else \
        rng.standard_normal((4 * steps, 8)).astype("float32")
    x, y = batches or (x, rng.standard_normal((4 * steps, 4)).astype("float32"))
    model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    values = [np.asarray(keras.ops.convert_to_numpy(keras.ops.cast(v.value, "float32")))
              for v in [*model.variables, *opt.variables]]
    return model, opt, values


def _same(a, b):
    return len(a) == len(b) and all(np.array_equal(x, y, equal_nan=True) for x, y in zip(a, b))


def _schedule():
    return keras.optimizers.schedules.ExponentialDecay(1e-2, decay_steps=2, decay_rate=0.5)


INNERS = {
    "AdamW": lambda: keras.optimizers.AdamW(1e-2, weight_decay=0.1),
    "Adam, schedule": lambda: keras.optimizers.Adam(_schedule(), beta_1=0.5, epsilon=1e-3),
    "Adam with weight decay": lambda: keras.optimizers.Adam(1e-2, weight_decay=0.05),
}


@pytest.mark.parametrize("inner", sorted(INNERS))
def test_the_op_steps_with_the_bits_of_keras_update(tf, traced, inner):
    model, opt, got = _fit(INNERS[inner])
    assert traced and traced[0] == len(model.trainable_variables)  # one op, every variable
    assert any(v.dtype == "bfloat16" for v in model.trainable_variables)
    assert any(v.dtype == "float32" for v in model.trainable_variables)  # LayerNormalization: its own master
    n = len(traced)
    _, _, want = _fit(INNERS[inner], native=False)
    assert len(traced) == n  # the reference ran without the op
    assert _same(got, want)
    assert int(opt.inner_optimizer.iterations.numpy()) == 6


@pytest.mark.parametrize("recipe", ["32-true", "bf16-mixed", "16-mixed"])
def test_without_masters_the_op_steps_the_fp32_variables_with_keras_bits(tf, traced, recipe):
    model, _, got = _fit(INNERS["AdamW"], recipe=recipe)
    assert set(traced) == {len(model.trainable_variables)}  # one op per trace, every variable
    assert all(v.dtype == "float32" for v in model.trainable_variables)
    n = len(traced)
    _, _, want = _fit(INNERS["AdamW"], native=False, recipe=recipe)
    assert len(traced) == n and _same(got, want)


def test_variables_keras_overwrites_with_their_gradient_stay_keras(tf, traced):
    def fit(native):
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16), keras.layers.Dense(4)])
        model.quantize("float8")  # Keras' own FP8: scale and amax-history variables set from their "gradient"
        opt = keras_ext.master_optimizer(INNERS["AdamW"](), "32-true")
        if not native:
            opt._native_update = lambda: None
        model.compile(opt, loss="mse", jit_compile=False)
        rng = np.random.default_rng(1)
        model.fit(rng.standard_normal((24, 8)).astype("float32"), rng.standard_normal((24, 4)).astype("float32"),
                  batch_size=4, verbose=0, shuffle=False)
        return model, [np.asarray(keras.ops.convert_to_numpy(v.value)) for v in [*model.variables, *opt.variables]]

    model, got = fit(True)
    overwritten = [v for v in model.trainable_variables if getattr(v, "overwrite_with_gradient", False)]
    assert overwritten and traced and max(traced) == len(model.trainable_variables) - len(overwritten)
    _, want = fit(False)
    assert _same(got, want)


@pytest.mark.parametrize("recipe", ["bf16-master", "bf16-mixed"])
def test_sparse_gradients_keep_keras_update_and_the_rest_is_the_op(tf, traced, recipe):
    model, _, got = _fit(INNERS["AdamW"], recipe=recipe, embedding=True)
    assert set(traced) == {len(model.trainable_variables) - 1}  # all but the embedding
    _, _, want = _fit(INNERS["AdamW"], native=False, recipe=recipe, embedding=True)
    assert _same(got, want)


def test_weight_decay_exclusions_are_keras(tf, traced):
    def inner():
        opt = keras.optimizers.AdamW(1e-2, weight_decay=0.5)
        opt.exclude_from_weight_decay(var_names=["bias", "gamma"])
        return opt

    _, _, got = _fit(inner)
    _, _, want = _fit(inner, native=False)
    assert traced and _same(got, want)


def test_scaled_gradients_are_divided_as_keras_does(tf, traced):
    scaler = {"enabled": True, "init_scale": 2.0**10}
    _, opt, got = _fit(INNERS["AdamW"], scaler=scaler)
    _, _, want = _fit(INNERS["AdamW"], native=False, scaler=scaler)
    assert traced and _same(got, want)
    assert opt.current_scale == 2.0**10


def test_a_skipped_step_writes_nothing(tf, traced):
    rng = np.random.default_rng(2)
    x, y = rng.standard_normal((8, 8)).astype("float32"), rng.standard_normal((8, 4)).astype("float32")
    x[5, 3] = np.inf  # the second step's gradients are not finite
    model, opt, _ = _fit(INNERS["AdamW"], batches=(x[:4], y[:4]))
    kept = [*model.trainable_variables, *opt.master_variables, *opt.inner_optimizer.variables]
    kept = [v for v in kept if v is not None]  # a FP32 variable is its own master
    before = [np.asarray(keras.ops.convert_to_numpy(v.value)) for v in kept]
    model.fit(x[4:], y[4:], batch_size=4, epochs=1, shuffle=False, verbose=0)
    assert traced and opt.skipped == 1
    assert all(np.array_equal(a, keras.ops.convert_to_numpy(v.value)) for a, v in zip(before, kept))
    assert int(opt.inner_optimizer.iterations.numpy()) == 1


DECLINED = {
    "SGD": (lambda: keras.optimizers.SGD(1e-2), {}),
    "amsgrad": (lambda: keras.optimizers.Adam(1e-2, amsgrad=True), {}),
    "clipnorm": (lambda: keras.optimizers.AdamW(1e-2, clipnorm=1.0), {}),
    "XLA": (INNERS["AdamW"], {"jit_compile": True}),
}


@pytest.mark.parametrize("case", sorted(DECLINED))
def test_what_the_op_cannot_take_keeps_keras_update(tf, traced, case):
    make, kw = DECLINED[case]
    model, _, values = _fit(make, compile_kw=kw)
    assert not traced
    assert all(np.isfinite(v).all() for v in values)


def test_under_a_distribution_strategy_keras_update_runs(tf, traced):
    with tf.distribute.OneDeviceStrategy("/cpu:0").scope():
        _, _, values = _fit(INNERS["AdamW"], recipe="bf16-mixed")
    assert not traced and all(np.isfinite(v).all() for v in values)


def test_off_with_the_switch(tf, traced, monkeypatch):
    monkeypatch.setattr(master_native, "NATIVE", False)
    assert master_native.native_master_adam() is None
    _fit(INNERS["AdamW"])
    assert not traced


def test_the_load_check_fails_a_kernel_that_differs_from_keras(tf):
    native = master_native.native_master_adam()
    op = native._op

    class Off(master_native.NativeMasterAdam):
        def __init__(self):
            self._op = lambda **kw: op(**{**kw, "epsilon": kw["epsilon"] * 2})

    with pytest.raises(RuntimeError, match="differs from Keras"):
        master_native._self_check(Off())


def test_a_failed_build_warns_once_and_keras_update_runs(tf, traced, monkeypatch):
    def fail(*args, **kwargs):
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(master_native, "build_op_library", fail)
    master_native._loaded.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match="no compiler here"):
            assert master_native.native_master_adam() is None
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            assert master_native.native_master_adam() is None  # once
            _, _, values = _fit(INNERS["AdamW"])
        assert not traced and all(np.isfinite(v).all() for v in values)
    finally:
        master_native._loaded.cache_clear()  # the next caller loads the real one again
