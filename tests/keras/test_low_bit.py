"""keras_ext.weights.low_bit: Adam's m and v held 8-bit block-quantized (state_dtype="8bit") against the core's NumPy
reference, step by step on the same gradients; under bf16-master and bf16-sr on a small classifier against FP32
states; a save/load round trip resumes bit for bit and stores the 8-bit bytes; the knob's errors."""

from __future__ import annotations

import keras
import numpy as np
import pytest

import keras_ext
from keras_ext.diagnostics import memory_report
from keras_ext.weights import AdamW8bit, eight_bit_inner
from mp_callbacks import get_recipe
from mp_callbacks.weights import NUMPY_QUANT_OPS as Q
from mp_callbacks.weights import (
    adam_step_8bit as adam_step,
)
from mp_callbacks.weights import (
    dequantize_8bit as dequantize,
)
from mp_callbacks.weights import (
    dynamic_map,
)
from mp_callbacks.weights import (
    quantize_8bit as quantize,
)


def u32(a) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(a, dtype=np.float32)).view(np.uint32)


def reference(p, grads, hyper):
    """The core's NumPy rule: FP32 state for small tensors, block-quantized for large ones."""
    sm, sv = dynamic_map(True), dynamic_map(False)
    big = p.size >= 4096 and p.size % 256 == 0
    m, v = np.zeros_like(p), np.zeros_like(p)
    out = []
    for t, g in enumerate(grads, start=1):
        p, m, v = adam_step(p, g, m, v, np.float32(t), decoupled=True, ops=Q, **hyper)
        if big:
            (cm, scm), (cv, scv) = quantize(m, sm, Q), quantize(v, sv, Q)
            m, v = dequantize(cm, scm, sm, Q), dequantize(cv, scv, sv, Q)
            out.append((p, cm, scm, cv, scv))
        else:
            out.append((p, m, v))
    return out


@pytest.mark.parametrize("shape", [(64, 128), (8, 8)])
def test_each_step_is_the_core_reference_on_the_same_gradients(shape):
    rng = np.random.default_rng(3)
    p0 = rng.standard_normal(shape).astype(np.float32)
    grads = [rng.standard_normal(shape).astype(np.float32) * 10.0 ** -k for k in range(4)]
    hyper = {"lr": 1e-2, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 1e-2}
    var = keras.Variable(p0.copy())
    opt = AdamW8bit(learning_rate=1e-2, weight_decay=1e-2)
    opt.build([var])
    for t, (g, want) in enumerate(zip(grads, reference(p0.copy(), grads, hyper)), start=1):
        opt.apply([keras.ops.convert_to_tensor(g)], [var])
        got = [keras.ops.convert_to_numpy(x) for x in (var, *opt.state_of(var))]
        if len(want) == 5:  # quantized: codes, scale (the map is held too)
            got = [got[0], got[1], got[2], got[4], got[5]]
        # The states are the rule's, bit for bit; the FP32 variable within 0.1% of one step's size per step (the
        # backend's vectorized kernels, FMA/sqrt/division on AVX-512 here, round differently from NumPy's order;
        # bit-equal on an AVX2-only CPU).
        assert got[0].dtype == want[0].dtype == np.float32
        np.testing.assert_allclose(got[0], want[0], rtol=0, atol=1e-3 * hyper["lr"] * t)
        for a, b in zip(got[1:], want[1:]):
            assert a.dtype == b.dtype and np.array_equal(a.view(np.uint8), np.ascontiguousarray(b).view(np.uint8))


def classifier_data(n: int = 512, dim: int = 64, classes: int = 4):
    rng = np.random.default_rng(0)
    centers = rng.standard_normal((classes, dim)).astype(np.float32)
    y = rng.integers(0, classes, n)
    x = (centers[y] + 0.8 * rng.standard_normal((n, dim))).astype(np.float32)
    return x, y


def fit(recipe: str, states: str | None, epochs: int = 4):
    keras.utils.set_random_seed(0)
    x, y = classifier_data()
    dtype = "float32" if recipe == "32-true" else "bfloat16"
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(64, activation="relu", dtype=dtype),  # 4096
                              keras.layers.Dense(4, dtype=dtype)])
    inner = keras.optimizers.AdamW(3e-3, epsilon=1e-8)
    opt = inner if recipe == "32-true" else keras_ext.master_optimizer(inner, recipe, state_dtype=states, seed=1)
    model.compile(opt, keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    hist = model.fit(x, y, batch_size=32, epochs=epochs, verbose=0, shuffle=False)
    return model, opt, hist.history


# bf16-master (slow, ~45 s): the same 8-bit states under masters; the per-step reference test and the parity test
# cover its arithmetic, bf16-sr the training
@pytest.mark.parametrize("recipe", ["bf16-sr", pytest.param("bf16-master", marks=pytest.mark.slow)])
def test_a_classifier_trains_with_8bit_states_as_with_fp32_states(recipe):
    _, _, fp32 = fit("32-true", None)
    model, opt, low = fit(recipe, "8bit")
    inner = opt.inner_optimizer
    assert isinstance(inner, AdamW8bit) and opt.recipe.master.state_dtype == "8bit"
    kernel = model.layers[0].kernel
    assert [keras.backend.standardize_dtype(s.dtype) for s in inner.states[0]] == [
        "uint8", "float32", "float32"] * 2 and keras.backend.standardize_dtype(kernel.dtype) == "bfloat16"
    assert fp32["accuracy"][-1] > 0.9
    assert low["accuracy"][-1] >= fp32["accuracy"][-1] - 0.03
    assert abs(low["loss"][-1] - fp32["loss"][-1]) <= 0.1 * fp32["loss"][0]
    report = memory_report(model, opt)
    assert report["optimizers"] == ["adamw8bit"]
    assert report["actual"]["optimizer_state"] == report["estimate"]["optimizer_state"]


def test_the_knob_wants_adam_or_adamw():
    plan = get_recipe("bf16-sr", state_dtype="8bit").master
    with pytest.raises(ValueError, match="must be keras.optimizers.Adam or AdamW"):
        eight_bit_inner(keras.optimizers.SGD(0.1, momentum=0.9), plan)
    with pytest.raises(ValueError, match="amsgrad"):
        eight_bit_inner(keras.optimizers.Adam(amsgrad=True), plan)
    assert isinstance(eight_bit_inner(keras.optimizers.Adam(), plan), AdamW8bit)
    sgd = keras.optimizers.SGD()
    assert eight_bit_inner(sgd, get_recipe("bf16-sr").master) is sgd


# ------------------------------------------------------------------ save, load, resume
def resumable(recipe: str, states: str | None = "8bit"):
    """A 64x64 hidden kernel (quantized states) under ``recipe``, AdamW through ``master_optimizer``."""
    keras.utils.set_random_seed(0)
    keras_ext.set_global_policy(recipe)
    try:
        model = keras_ext.apply_policy(keras.Sequential([keras.Input((64,)), keras.layers.Dense(64, activation="relu"),
                                                         keras.layers.Dense(4)]))
    finally:
        keras_ext.set_global_policy("32-true")
    model.compile(keras_ext.master_optimizer(keras.optimizers.AdamW(3e-3), recipe, state_dtype=states, seed=1),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def resume_data():
    x, y = classifier_data(n=64)
    w = np.ones(64, "float32")
    w[20] = np.inf  # a skipped step in the first epoch
    return x, y, w


def held(model) -> list[np.ndarray]:
    return [np.array(keras.ops.convert_to_numpy(v)) for v in model.weights + model.optimizer.variables]


def archive_state_bytes(path) -> int:
    """Bytes of the inner optimizer's per-parameter variables as stored in a ``.keras`` archive."""
    import io
    import zipfile

    import h5py

    with zipfile.ZipFile(path) as archive, h5py.File(io.BytesIO(archive.read("model.weights.h5"))) as f:
        group = f["optimizer/inner_optimizer/vars"]
        return sum(group[k].nbytes for k in group if group[k].ndim > 0)


@pytest.mark.parametrize("recipe", ["bf16-sr", pytest.param("bf16-master", marks=pytest.mark.slow)])  # ~18 s each
def test_save_load_resume_is_bit_for_bit_and_the_archive_holds_the_8bit_bytes(tmp_path, recipe):
    """Saved after one epoch (a skipped step in it), loaded by ``keras_ext.load_model``, one more epoch: the
    uninterrupted run's weights, masters, codes, scales and counters; the archive stores the states at the
    bytes the memory report counts, the estimator's 8-bit figure, far under FP32 states'."""
    x, y, w = resume_data()
    fit_kw = dict(batch_size=8, shuffle=False, verbose=0)
    reference = resumable(recipe)
    reference.fit(x, y, sample_weight=w, epochs=2, **fit_kw)
    model = resumable(recipe)
    model.fit(x, y, sample_weight=w, epochs=1, **fit_kw)
    keras_ext.save_model(model, tmp_path / "q.keras")
    loaded = keras_ext.load_model(tmp_path / "q.keras")
    assert isinstance(loaded.optimizer.inner_optimizer, AdamW8bit)
    loaded.fit(x, y, sample_weight=w, epochs=1, **fit_kw)
    assert loaded.optimizer.skipped == reference.optimizer.skipped == 2
    for a, b, v in zip(held(reference), held(loaded), reference.weights + reference.optimizer.variables, strict=True):
        np.testing.assert_array_equal(a, b, err_msg=v.path)

    report = memory_report(loaded, loaded.optimizer)
    stored = archive_state_bytes(tmp_path / "q.keras")
    assert stored == report["actual"]["optimizer_state"] == report["estimate"]["optimizer_state"]
    plain = resumable(recipe, states=None)
    plain.fit(x[:8], y[:8], epochs=1, **fit_kw)
    fp32_states = memory_report(plain, plain.optimizer)["actual"]["optimizer_state"]
    assert fp32_states == 8 * sum(int(np.prod(v.shape)) for v in plain.trainable_variables)
    big = 64 * 64  # the quantized kernel: 1 B code per element, a float32 scale per 256, the 256-entry map; m and v
    assert stored == fp32_states - 2 * (4 * big - (big + 4 * big // 256 + 4 * 256))
