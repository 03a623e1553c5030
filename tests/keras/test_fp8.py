"""``fp8-mixed`` in Keras: side by side with Keras's own float8 ``Dense``, the states against the core
transition, the skip of a non-finite amax, FP32 layers, masters, attention projections.

Side by side (``test_matches_keras_own_float8_dense``): Keras's ``Dense(...).quantize("float8")``
and our FP8 ``Dense`` (the ``keras`` preset: Keras's update order and stored inverse scale) start
from the same kernel and train with the same batches under the ``float32`` policy.  Without a bias
everything is equal bit for bit every step: outputs, kernels, and each role's amax history and
Keras's ``scale`` = our ``scale_inv``.  With a bias the one difference is Keras's: under float32
compute its float8 layer rounds the bias to bfloat16 before adding it (a TensorFlow fusion
workaround, ``dense.py``); the outputs then differ by that rounding, at most ``2**-8 |b|`` per
element, plus the float32 rounding of the sums (checked at the first step, before the paths part).
"""

from __future__ import annotations

import numpy as np
import pytest

keras = pytest.importorskip("keras")
from keras import ops  # noqa: E402

import keras_ext  # noqa: E402
from keras_ext.fp8 import enable_fp8, fp8_layers, fp8_state, is_fp8_variable  # noqa: E402
from mp_callbacks.fp8 import (  # noqa: E402
    FP8_ROLES,
    FP8Recipe,
    fp8_amax,
    next_fp8_state,  # noqa: E402
)

f32 = np.float32
TF = keras.backend.backend() == "tensorflow"
EAGER = True  # a traced train step costs ~10 s to build here (custom gradients, float8 casts); steps are tiny
KERAS_NAMES = {"inputs": "inputs", "weights": "kernel", "grad_outputs": "outputs_grad"}


def same(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and np.array_equal(a.view(np.int32) if a.dtype == f32 else a,
                                                 b.view(np.int32) if b.dtype == f32 else b)


def _train_step(layer, optimizer):
    if TF:
        import tensorflow as tf

        @tf.function
        def step(x, dy):
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(layer(x, training=True) * dy)
            grads = tape.gradient(loss, layer.trainable_variables)
            optimizer.apply(grads, layer.trainable_variables)

        return lambda x, dy: step(ops.convert_to_tensor(x), ops.convert_to_tensor(dy))
    import torch

    def step(x, dy):
        loss = (layer(ops.convert_to_tensor(x), training=True) * ops.convert_to_tensor(dy)).sum()
        grads = torch.autograd.grad(loss, [v.value for v in layer.trainable_variables], allow_unused=True)
        optimizer.apply(list(grads), layer.trainable_variables)

    return step


@pytest.mark.parametrize("use_bias", [False, True])
def test_matches_keras_own_float8_dense(use_bias):
    rng = np.random.default_rng(0)
    theirs, ours = keras.layers.Dense(5, use_bias=use_bias), keras.layers.Dense(5, use_bias=use_bias)
    for layer in (theirs, ours):
        layer.build((None, 4))
    ours.kernel.assign(theirs.kernel)
    if use_bias:
        theirs.bias.assign(rng.normal(size=5).astype(f32))
        ours.bias.assign(theirs.bias)
    theirs.quantize("float8")
    enable_fp8(ours, FP8Recipe("keras"))
    opts = [keras.optimizers.SGD(0.05) for _ in range(2)]
    for opt, layer in zip(opts, (theirs, ours)):
        opt.build(layer.trainable_variables)
    steps = [_train_step(theirs, opts[0]), _train_step(ours, opts[1])]
    for t in range(6):
        x = (rng.normal(size=(3, 4)) * 10.0 ** rng.uniform(-2, 2)).astype(f32)
        dy = (rng.normal(size=(3, 5)) * 10.0 ** rng.uniform(-3, 1)).astype(f32)
        y_theirs, y_ours = (ops.convert_to_numpy(layer(x, training=False)) for layer in (theirs, ours))
        if not use_bias:
            assert same(y_theirs, y_ours), t
        elif t == 0:
            b = ops.convert_to_numpy(theirs.bias)
            rounded = ops.convert_to_numpy(ops.cast(ops.cast(theirs.bias, "bfloat16"), "float32"))
            diff = np.abs(y_theirs - y_ours)
            rounding = 2.0**-23 * (np.abs(y_ours) + np.abs(b))  # float32 rounding of the two sums
            assert (diff <= np.abs(b - rounded) + rounding).all()
            assert (np.abs(b - rounded) <= 2.0**-8 * np.abs(b)).all()  # bfloat16: half an ulp, 2**-8 relative
        for step in steps:
            step(x, dy)
        if not use_bias:
            assert same(ops.convert_to_numpy(theirs._kernel), ops.convert_to_numpy(ours.kernel)), t
        for role, name in KERAS_NAMES.items():
            state = fp8_state(ours, role)
            keras_scale = ops.convert_to_numpy(getattr(theirs, f"{name}_scale"))
            keras_history = ops.convert_to_numpy(getattr(theirs, f"{name}_amax_history"))
            if not use_bias or role != "grad_outputs" or t == 0:
                assert same(keras_scale, state.scale_inv), (t, role)
                assert same(keras_history, state.amax_history), (t, role)


def build_mlp(recipe="fp8-mixed", fp8=None, attention=False):
    keras_ext.set_global_policy(recipe if fp8 is None else keras_ext_recipe(fp8))
    keras.utils.set_random_seed(0)
    inp = keras.Input((8,))
    h = keras.layers.Dense(16, activation="tanh", name="d1")(inp)
    if attention:
        t = keras.layers.Reshape((2, 8))(h)
        t = keras.layers.MultiHeadAttention(2, 4, name="mha")(t, t)
        h = keras.layers.Flatten()(t)
    h = keras.layers.LayerNormalization(name="norm")(h)
    h = keras.layers.Dense(16, activation="tanh", name="d2")(h)
    out = keras.layers.Dense(1, name="head")(h)
    return keras_ext.apply_policy(keras.Model(inp, out))


def keras_ext_recipe(fp8):
    from mp_callbacks.recipes import get_recipe

    return get_recipe("fp8-mixed", fp8=fp8)


def data(n=48, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 8)).astype(f32)
    return x, (x[:, :1] * 2 - x[:, 1:2]).astype(f32)


def fit_steps(model, x, y, steps, bad=()):
    optimizer = keras_ext.master_optimizer(keras.optimizers.AdamW(1e-2), "fp8-mixed")
    model.compile(optimizer, "mse", run_eagerly=EAGER)
    seen = []
    for t in range(steps):
        xb, yb = x[8 * t: 8 * t + 8].copy(), y[8 * t: 8 * t + 8]
        if t in bad:
            xb[0, 0] = np.inf
        before = [ops.convert_to_numpy(v) for v in model.trainable_variables if not is_fp8_variable(v)]
        model.train_on_batch(xb, yb)
        seen.append({"x": xb, "before": before,
                     "states": {p: {r: fp8_state(layer, r) for r in FP8_ROLES} for p, layer in fp8_layers(model)}})
    return optimizer, seen


@pytest.mark.parametrize("fp8", [{"preset": "keras", "history_len": 4}, {"mode": "current"}])  # TE: attention test
def test_states_follow_the_core_transition(fp8):
    """Each step's states are the core transition of the previous ones with the amax the step recorded
    (read back from the history: Transformer Engine's last slot, Keras's slot 0); the first layer's
    input amax is the batch's (in bfloat16, the layer's compute dtype).  Current scaling keeps no
    history (length 1): there the first layer's input scale is fp8 max / the batch's amax."""
    model = build_mlp(fp8=fp8)
    recipe = keras_ext.get_global_recipe().fp8
    assert [p for p, _ in fp8_layers(model)] == ["d1", "d2"]  # the head and the norm stay FP32
    x, y = data()
    optimizer, seen = fit_steps(model, x, y, 5)
    for path in ("d1", "d2"):
        prev = {r: _zero(recipe.configs[r]) for r in FP8_ROLES}
        for t, s in enumerate(seen):
            batch_amax = fp8_amax(ops.convert_to_numpy(ops.cast(ops.cast(s["x"], "bfloat16"), "float32")))
            for role in FP8_ROLES:
                cfg = recipe.configs[role]
                got = s["states"][path][role]
                if recipe.mode == "current":
                    assert same(got.scale_inv, f32(1) / got.scale) and got.scale > 0
                    if path == "d1" and role == "inputs":
                        assert same(got.scale, f32(cfg.fmt.max) / batch_amax), t
                    continue
                amax = got.amax_history[-1] if cfg.update_order == "record_first" else got.amax_history[0]
                want, ok = next_fp8_state(cfg, prev[role], amax)
                assert ok and same(want.scale, got.scale) and same(want.scale_inv, got.scale_inv), (path, t, role)
                assert same(want.amax_history, got.amax_history), (path, t, role)
                if path == "d1" and role == "inputs":
                    assert amax == batch_amax, t
            prev = s["states"][path]
    assert optimizer.skipped == 0


def _zero(cfg):
    from mp_callbacks.fp8 import initial_fp8_state

    return initial_fp8_state(cfg)


def test_a_non_finite_amax_skips_the_step_and_keeps_the_states():
    model = build_mlp(fp8={"history_len": 8})
    x, y = data()
    optimizer, seen = fit_steps(model, x, y, 5, bad={2})
    assert (optimizer.overflows, optimizer.skipped) == (1, 1)
    after_bad = [ops.convert_to_numpy(v) for v in model.trainable_variables if not is_fp8_variable(v)]
    assert all(np.array_equal(a, b) for a, b in zip(seen[2]["before"], seen[3]["before"]))  # nothing applied
    for path in ("d1", "d2"):
        for role in FP8_ROLES:
            a, b = seen[1]["states"][path][role], seen[2]["states"][path][role]
            assert same(a.amax_history, b.amax_history) and same(a.scale, b.scale), (path, role)
            assert np.isfinite(seen[4]["states"][path][role].amax_history).all()
    assert len(after_bad) == len(seen[0]["before"])


def test_fp32_layers_masters_and_slots():
    model = build_mlp()
    x, y = data()
    optimizer, _ = fit_steps(model, x, y, 1)
    dtypes = {v.path: keras.backend.standardize_dtype(v.dtype) for v in model.weights}
    assert dtypes["d1/kernel"] == "bfloat16" and dtypes["head/kernel"] == "float32"
    assert dtypes["norm/gamma"] == "float32"
    assert all(d == "float32" for p, d in dtypes.items() if "fp8_" in p)
    masters = [m for m in optimizer.master_variables if m is not None]
    assert masters and all(keras.backend.standardize_dtype(m.dtype) == "float32" for m in masters)
    slots = [v for v in optimizer.inner_optimizer.variables if len(v.shape) > 0]
    assert all(keras.backend.standardize_dtype(v.dtype) == "float32" for v in slots)


def test_attention_projections_run_fp8():
    model = build_mlp(attention=True, fp8={"history_len": 4})
    paths = [p for p, _ in fp8_layers(model)]
    assert {"mha.query", "mha.key", "mha.value", "mha.attention_output"} <= set(paths), paths
    x, y = data()
    fit_steps(model, x, y, 2)
    for path, layer in fp8_layers(model):
        for role in FP8_ROLES:
            assert fp8_state(layer, role).amax_history.max() > 0, (path, role)


def test_monitor_logs_the_fp8_metrics_and_memory():
    from mp_callbacks.diagnostics import FP8_AMAX, FP8_SATURATED_FRAC, FP8_SCALE, FP8_UNDERFLOW_FRAC, GRAD_NORM
    from mp_callbacks.fp8 import flushed_fraction, saturated_fraction

    model = build_mlp(fp8={"history_len": 4})
    x, y = data(32)
    optimizer = keras_ext.master_optimizer(keras.optimizers.AdamW(1e-2), "fp8-mixed")
    model.compile(optimizer, "mse", run_eagerly=EAGER)
    monitor = keras_ext.MixedPrecisionMonitor(log_every_n_steps=2)
    scales = []

    class Keep(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            scales.append(fp8_state(dict(fp8_layers(model))["d1"], "inputs").scale)

    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0, callbacks=[Keep(), monitor])
    logged = [s for s in monitor.history if s.fp8]
    assert [s.step for s in logged] == [2, 4]
    m = logged[-1].metrics()
    xb = ops.convert_to_numpy(ops.cast(ops.cast(x[24:32], "bfloat16"), "float32"))
    assert m[f"{FP8_AMAX}/d1/inputs"] == fp8_amax(xb)
    assert m[f"{FP8_SCALE}/d1/inputs"] == float(fp8_state(dict(fp8_layers(model))["d1"], "inputs").scale)
    assert m[f"{FP8_SATURATED_FRAC}/d1/inputs"] == saturated_fraction(xb, scales[3])
    assert m[f"{FP8_UNDERFLOW_FRAC}/d1/inputs"] == flushed_fraction(xb, scales[3])
    assert {f"{FP8_AMAX}/d2/grad_outputs", FP8_SATURATED_FRAC, FP8_UNDERFLOW_FRAC} <= set(m)
    assert m[GRAD_NORM] < 1e3  # the FP8 variables' "gradients" (new scales, ~1e4) are not gradients
    end = monitor.memory_reports[-1]
    assert end["actual"]["fp8_state"] == end["estimate"]["fp8_state"] > 0
    assert end["actual"]["bytes_per_param"] == end["estimate"]["bytes_per_param"]


def test_save_weights_round_trip_carries_the_fp8_states(tmp_path):
    model = build_mlp(fp8={"history_len": 4})
    x, y = data(24)
    fit_steps(model, x, y, 2)
    path = str(tmp_path / "fp8.weights.h5")
    model.save_weights(path)
    other = build_mlp(fp8={"history_len": 4})
    other.load_weights(path)
    assert all(np.array_equal(ops.convert_to_numpy(a), ops.convert_to_numpy(b))
               for a, b in zip(model.weights, other.weights, strict=True))
    assert fp8_state(dict(fp8_layers(other))["d1"], "weights").scale != 1.0


def test_fsdp_float8_all_gather_is_refused_with_the_reason():
    with pytest.raises(ValueError, match="torch FSDP2.*Keras has no FSDP2"):
        build_mlp(fp8={"fsdp_float8_all_gather": True})
    keras_ext.set_global_policy("32-true")
