"""``master_remainders`` in Keras (keras_ext.weights.remainders): the keras.ops join/split are the core's NumPy
reference bit for bit; given the same gradients (inf steps skipped) the FP32 masters, slots and scaler state are the
FP32-copy ``bf16-master``'s bit for bit; save/load resumes exactly (ties included); the masters hold 2 B/param."""

from __future__ import annotations

import keras
import numpy as np
import pytest
from keras import ops

import keras_ext
from keras_ext.diagnostics import memory_report
from keras_ext.weights import RemainderMaster, join, split
from mp_callbacks.recipes import get_recipe
from mp_callbacks.weights import bf16_bits, join_master, split_master, ties_differ

TF = keras.backend.backend() == "tensorflow"
REMAINDERS = get_recipe("bf16-master", master_remainders=True)
SCALER = {"enabled": True, "init_scale": 2.0**10, "growth_interval": 3}
OPTIMIZERS = {
    "adamw": lambda: keras.optimizers.AdamW(learning_rate=1e-2, weight_decay=0.1),
    "sgd-momentum": lambda: keras.optimizers.SGD(learning_rate=1e-2, momentum=0.9),
    "adam": lambda: keras.optimizers.Adam(learning_rate=1e-2),
    "rmsprop": lambda: keras.optimizers.RMSprop(learning_rate=1e-3),
}


def u32(x) -> np.ndarray:
    return np.asarray(ops.convert_to_numpy(x), dtype=np.float32).view(np.uint32)


def u16(bf16) -> np.ndarray:
    return np.asarray(ops.convert_to_numpy(ops.view(ops.cast(bf16, "bfloat16"), "int16"))).view(np.uint16)


def _compiled(fn, mode: str):
    if mode == "eager" or not TF:
        return fn
    import tensorflow as tf

    return tf.function(fn, jit_compile=mode == "xla")


def _patterns() -> np.ndarray:
    low16 = np.arange(2**16, dtype=np.uint32)
    upper = np.array([0x0000, 0x3F80, 0x3F81, 0xBF80, 0x7F7F, 0x7F80, 0xFFC0], dtype=np.uint32)
    every = ((upper[:, None] << 16) | low16[None, :]).ravel()
    rand = np.random.default_rng(0).integers(0, 2**32, 100_000, dtype=np.uint64).astype(np.uint32)
    edges = np.array([0x8000, 0x18000, 0x80008000, 0x7F7F8000, 0x7FFFFFFF, 0xFFFFFFFF, 0x80000000, 1], np.uint32)
    return np.concatenate([every, rand, edges])


@pytest.mark.parametrize("mode", ["eager", "graph", "xla"] if TF else ["eager"])
def test_keras_join_and_split_are_the_numpy_reference(mode):
    """Every lower half under several upper halves (ties, inf, NaN, -0, subnormals), random patterns."""
    b = _patterns()
    want_w, want_r = split_master(b.view(np.float32))
    fn = _compiled(lambda x, w, r: (*split(x), join(w, r)), mode)
    forward = ops.view(ops.convert_to_tensor(want_w.view(np.int16)), "bfloat16")
    w, r, x = fn(ops.convert_to_tensor(b.view(np.float32)), forward, ops.convert_to_tensor(want_r))
    np.testing.assert_array_equal(u16(w), want_w)
    np.testing.assert_array_equal(np.asarray(ops.convert_to_numpy(r)), want_r)
    np.testing.assert_array_equal(u32(x), join_master(want_w, want_r).view(np.uint32))
    np.testing.assert_array_equal(u32(x), b)


def _model(recipe: str = "bf16-master") -> keras.Model:
    keras.utils.set_random_seed(0)
    keras_ext.set_global_policy(recipe)
    return keras_ext.apply_policy(keras.Sequential([
        keras.Input((6,)), keras.layers.Dense(8, activation="tanh"), keras.layers.LayerNormalization(),
        keras.layers.Dense(5, activation="tanh"), keras.layers.Dense(3)]))


def _masters(opt, tvs) -> list[np.ndarray]:
    return [u32(v if m is None else m.value) if v.dtype != "bfloat16" or m is not None else None
            for v, m in zip(tvs, opt.master_variables)]


def _slots(opt) -> list[np.ndarray]:
    return [np.array(ops.convert_to_numpy(s)) for s in opt.inner_optimizer.variables]


def _stepper(opt, tvs):
    return lambda grads: opt.apply(grads, tvs)


# Every optimizer eagerly (its arithmetic); traced, one (the same code under tf.function: what a trace changes is
# the step's control flow, not the optimizer's update).
@pytest.mark.parametrize(("mode", "name"), [*(("eager", n) for n in sorted(OPTIMIZERS)), *([("graph", "adamw")] if TF
                                                                                           else [])])
def test_same_gradients_give_the_fp32_copy_masters_bit_for_bit(name, mode):
    """The same bf16 gradients (inf on steps 2, 3 and 7: skipped, the scale backs off; one missing gradient)
    into the FP32-copy and the remainder optimizer: masters, slots, iterations and scaler state bit for bit;
    the bf16 weights are nearest-even of the master (FP32 copy) and the core's split of it (remainders)."""
    runs = []
    for recipe in ("bf16-master", REMAINDERS):
        model = _model()
        opt = keras_ext.master_optimizer(OPTIMIZERS[name](), recipe, scaler=SCALER)
        opt.build(model.trainable_variables)
        runs.append((model.trainable_variables, opt, _compiled(_stepper(opt, model.trainable_variables), mode)))
    (tv0, copy, _), (tv1, rem, _) = runs
    own = [v.dtype for v in rem._variables if tuple(v.shape) == tuple(tv1[0].shape)]  # not the inner's slots
    assert isinstance(rem.master_variables[0], RemainderMaster) and own == ["int16"]
    assert all(np.array_equal(a, b) for a, b in zip(_masters(copy, tv0), _masters(rem, tv1), strict=True))
    r = np.random.default_rng(1)
    for step in range(10):
        grads = [(r.standard_normal(v.shape) * 100).astype(np.float32) for v in tv0]
        if step in (2, 3, 7):
            grads[step % len(grads)].flat[0] = np.inf
        for tvs, _, fn in runs:
            fn([None if (step == 5 and i == 4) else ops.cast(g, v.dtype) for i, (g, v) in enumerate(zip(grads, tvs))])
        for a, b in zip(_masters(copy, tv0), _masters(rem, tv1), strict=True):
            np.testing.assert_array_equal(a, b, err_msg=f"step {step}")
        for a, b in zip(_slots(copy), _slots(rem), strict=True):
            np.testing.assert_array_equal(a, b, err_msg=f"step {step}")
        assert copy.scaler_state_dict() == rem.scaler_state_dict()
        for v0, v1, m in zip(tv0, tv1, rem.master_variables):
            if m is not None:
                x = np.asarray(m.numpy(), np.float32)
                np.testing.assert_array_equal(u16(v0), bf16_bits(x))
                np.testing.assert_array_equal(u16(v1), split_master(x)[0])
    assert copy.loss_scaler.skipped == rem.loss_scaler.skipped == 3
    assert int(ops.convert_to_numpy(rem.iterations)) == int(ops.convert_to_numpy(copy.iterations)) == 7


def _data():
    r = np.random.default_rng(3)
    x = r.standard_normal((48, 6)).astype("float32")
    y = np.tanh(x @ r.standard_normal((6, 3))).astype("float32")
    w = np.ones(48, "float32")
    w[[9, 33]] = np.inf  # batches 2 and 8 of 12: an inf loss, skipped
    return x, y, w


def _fit(model, epochs=1):
    x, y, w = _data()
    model.fit(x, y, sample_weight=w, batch_size=4, epochs=epochs, shuffle=False, verbose=0)


def _fitted():
    model = _model()
    model.compile(keras_ext.master_optimizer(keras.optimizers.AdamW(1e-2), REMAINDERS, scaler=SCALER), "mse")
    _fit(model)
    return model


def _with_ties(opt) -> None:
    """Put exact ties that nearest-even rounds down (lower half 0x8000, bit 16 clear) into the first master."""
    m = opt.master_variables[0]
    b = u32(m.value).copy()
    b.flat[:5] = (b.flat[:5] & np.uint32(0xFFFE0000)) | np.uint32(0x8000)
    m.assign(b.view(np.float32))
    assert ties_differ(b.view(np.float32)).sum() >= 5


def _state(model):
    return ([u32(ops.cast(v, "float32")) for v in model.weights], _masters(model.optimizer, model.trainable_variables),
            _slots(model.optimizer), model.optimizer.scaler_state_dict())


def _assert_same(a, b):
    for x, y in zip(a[0] + [m for m in a[1] if m is not None] + a[2], b[0] + [m for m in b[1] if m is not None] + b[2],
                    strict=True):
        np.testing.assert_array_equal(x, y)
    assert a[3] == b[3]


@pytest.mark.parametrize("route", ["model.save", "keras_ext.save_model", "save_weights"])
def test_save_load_resumes_exactly(tmp_path, route):
    """After an epoch (ties put into a master): save, load (load_model with safe_mode, or load_weights into a new
    model), one more epoch: weights, masters, slots and scaler state equal the run that went on; the file holds
    the FP32 masters in the optimizer's record (and, through keras_ext.save_model, as the weights)."""
    reference_model = _fitted()
    _with_ties(reference_model.optimizer)
    before = _state(reference_model)
    if route == "save_weights":
        reference_model.save_weights(tmp_path / "m.weights.h5")
        resumed = _model()
        resumed.compile(keras_ext.master_optimizer(keras.optimizers.AdamW(1e-2), REMAINDERS, scaler=SCALER), "mse")
        resumed.optimizer.build(resumed.trainable_variables)
        resumed.load_weights(tmp_path / "m.weights.h5")
    else:
        path = tmp_path / "m.keras"
        if route == "model.save":
            reference_model.save(path)
        else:
            keras_ext.save_model(reference_model, path)
            fp32 = _model("32-true")
            fp32.load_weights(path)
            for v, m in zip(fp32.trainable_variables, _masters(reference_model.optimizer,
                                                               reference_model.trainable_variables)):
                np.testing.assert_array_equal(u32(v), m)
        resumed = keras.models.load_model(path, safe_mode=True)
    assert resumed.optimizer.recipe.master.master_remainders
    _assert_same(before, _state(resumed))
    for model in (reference_model, resumed):
        _fit(model)
    _assert_same(_state(reference_model), _state(resumed))


@pytest.mark.parametrize("jit_compile", ["auto", False] if TF else ["auto"])
def test_fit_follows_the_fp32_copy_run_bit_for_bit(jit_compile):
    """model.fit through the backend's trainer (TensorFlow: tf.function, Keras' jit choice or none; JAX: the
    jitted stateless step), inf losses skipped: the seeded run meets no tie (where the forward weights, then the
    gradients, would differ by design), so both runs end with the same masters, slots and scaler state bit for
    bit; the weights are nearest-even of the master (FP32 copy) and the core's split of it (remainders)."""
    models = []
    for recipe in ("bf16-master", REMAINDERS):
        model = _model()
        model.compile(keras_ext.master_optimizer(keras.optimizers.AdamW(1e-2), recipe, scaler=SCALER),
                      "mse",
                      jit_compile=jit_compile)
        _fit(model, epochs=2)
        models.append(model)
    copy, rem = (_state(m) for m in models)
    _assert_same(([], copy[1], copy[2], copy[3]), ([], rem[1], rem[2], rem[3]))
    assert models[1].optimizer.loss_scaler.skipped == 4
    for v0, v1, m in zip(models[0].trainable_variables, models[1].trainable_variables, rem[1]):
        if v0.dtype == "bfloat16":
            np.testing.assert_array_equal(u16(v0), bf16_bits(m.view(np.float32)))
            np.testing.assert_array_equal(u16(v1), split_master(m.view(np.float32))[0])


@pytest.mark.multiprocess
@pytest.mark.skipif(not TF, reason="TensorFlow's BFC allocator")
def test_held_between_steps_measured_by_the_allocator():
    """Measured (TF's BFC allocator, a subprocess): between steps the bf16 weights, int16 remainders and FP32
    states only (the core's count with the masters at 2 B/param), 2 B/param below the FP32 copy's count."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    from mp_callbacks.memory import estimate_memory

    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-m", "tests.keras.helpers.master_memory", "256", "16", "remainders"],
                          cwd=root, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    n = got["params"]
    params = [(n - 256, "bfloat16"), (256, "float32")]
    ours, copy = (estimate_memory(r.master, "adam", params) for r in (REMAINDERS, get_recipe("bf16-master")))
    between = ours.weights + ours.masters + ours.optimizer_state
    assert between == copy.weights + copy.masters + copy.optimizer_state - 2 * (n - 256)
    assert between <= got["held"] < between + n  # (an FP32 master kept: + 4 B/param)


def test_monitor_meters_memory_report_and_export_read_the_joined_masters():
    """A MixedPrecisionMonitor attached to both runs: the same series (scale, skips, gradient meters, swamping
    measured on the joined FP32 masters) as the FP32 copy; its memory report and ``memory_report`` count 2 B/param
    of masters held (the FP32 copy: 4.0); ``fp32_values`` exports the FP32 masters."""
    from keras_ext import MixedPrecisionMonitor

    history, reports, held = {}, {}, {}
    for recipe in ("bf16-master", REMAINDERS):
        model = _model()
        model.compile(keras_ext.master_optimizer(keras.optimizers.AdamW(1e-2), recipe, scaler=SCALER),
                      "mse",
                      jit_compile=False)
        monitor = MixedPrecisionMonitor(log_every_n_steps=1)
        x, y, w = _data()
        model.fit(x, y, sample_weight=w, batch_size=4, epochs=1, shuffle=False, verbose=0, callbacks=[monitor])
        key = "remainders" if recipe is REMAINDERS else recipe
        history[key] = {name: monitor.history.series(name) for name in
                        ("mp/scale", "mp/skipped_total", "mp/grad_norm", "mp/update_swamped_frac")}
        low = sum(int(np.prod(v.shape)) for v in model.trainable_variables if v.dtype == "bfloat16")
        reports[key] = monitor.memory_reports[-1]["actual"]["masters"] / low
        held[key] = memory_report(model, model.optimizer)["actual"]["masters"] / low
        masters = _masters(model.optimizer, model.trainable_variables)
        for v, value in zip(model.weights, keras_ext.fp32_values(model)):
            if v.dtype == "bfloat16":
                m = masters[[id(t) for t in model.trainable_variables].index(id(v))]
                np.testing.assert_array_equal(value.view(np.uint32), m)
    for name, series in history["bf16-master"].items():  # (NaN on the skipped steps' gradient norm)
        np.testing.assert_array_equal(np.array(history["remainders"][name], float), np.array(series, float), name)
    assert any(v is not None for v in history["remainders"]["mp/update_swamped_frac"])
    assert reports == held == {"bf16-master": 4.0, "remainders": 2.0}
