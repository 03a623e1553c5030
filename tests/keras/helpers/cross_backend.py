"""The same monitor and divergence runs on whichever Keras backend is loaded, as JSON-able dicts:
tests/keras/test_jax_backend.py runs them in its TensorFlow process and in the JAX subprocess
(tests/keras/helpers/jax_backend.py) and compares the two."""

import keras
import numpy as np
from keras import ops

import keras_ext
from mp_callbacks.diagnostics import DivergenceError
from tests.keras.helpers.models import RecordLogs, fit, tiny_regressor

INF_STEPS = (2, 3, 7)  # 0-based batches with an inf sample weight


def _scaler_row(s) -> list:
    return [s.step, s.overflow, s.scale, s.overflows_total, s.skipped_total, s.growths_total]


def _count_syncs(model) -> list:
    """JAX: one entry per ``jax_state_sync`` that wrote the trainer's state into the variables (Keras'
    ``Callback.model`` getter syncs too, so a callback that touches it every step syncs every step)."""
    calls: list = []
    original = getattr(model, "jax_state_sync", None)
    if original is None:
        return calls

    def counting():
        if getattr(model, "_jax_state", None) and not model._jax_state_synced:
            calls.append(1)
        original()

    model.jax_state_sync = counting
    return calls


def monitor_run(jit: bool | None = None) -> dict:
    """fp16 with overflows at batches 2, 3, 7 of 10 (two epochs), monitor logging every 5th step; ``jit``:
    ``compile(jit_compile=...)``, default: on JAX only (the JAX trainer's jitted step)."""
    keras.config.set_dtype_policy("mixed_float16")
    try:
        model = tiny_regressor()
        rng = np.random.default_rng(1)  # the same initial weights on every backend (their RNGs differ)
        model.set_weights([rng.normal(scale=0.3, size=w.shape).astype("float32") for w in model.get_weights()])
        opt = keras_ext.LossScaleOptimizer(keras.optimizers.SGD(1e-2), {"init_scale": 2.0**4, "growth_interval": 3})
        model.compile(opt, "mse", jit_compile=keras.backend.backend() == "jax" if jit is None else jit)
        monitor = keras_ext.MixedPrecisionMonitor(log_every_n_steps=5, log_memory=False)
        rec = RecordLogs()
        syncs = _count_syncs(model)
        history = fit(model, monitor, 10, inf_steps=INF_STEPS, epochs=2, callbacks=[rec])
        logged = [{k: v for k, v in r.items() if k.startswith("mp/")} for r in rec.rows]
        store: dict = {}
        opt.save_own_variables(store)
        return {
            "rows": [{k: (float(v) if np.isfinite(v) else None) for k, v in r.items()} for r in logged if r],
            "logged_steps": [k + 1 for k, r in enumerate(logged) if r],
            "history": [_scaler_row(s) for s in monitor.history],
            "measured": [[s.step, s.grad_norm is not None, s.grad_underflow_frac is not None,
                          s.update_swamped_frac is not None] for s in monitor.history],
            "epoch": {k: [float(x) for x in v] for k, v in history.history.items() if k.startswith("mp/")},
            "detached": opt.monitor is None, "step_state": [v.name for v in opt.step_state.variables],
            "saved": len(store), "inner": len(opt.inner_optimizer.variables), "syncs": len(syncs),
        }
    finally:
        keras.config.set_dtype_policy("float32")


class GradNaN(keras.layers.Layer):
    """Identity forward (``x + sqrt(|x - stop_gradient(x)|)``), a non-finite gradient backward: a finite loss
    whose gradients overflow, on every backend."""

    def call(self, x):
        return x + ops.sqrt(ops.abs(x - ops.stop_gradient(x)))


def _snapshot(model, opt) -> list:
    values = list(model.weights) + [m for m in opt.master_variables if m is not None] + \
        list(opt.inner_optimizer.variables)
    return [np.array(ops.convert_to_numpy(v)) for v in values]


def _stop(model, opt, x, y, callbacks=()) -> dict:
    before = _snapshot(model, opt)
    try:
        model.fit(x, y, batch_size=2, epochs=1, shuffle=False, verbose=0, callbacks=list(callbacks))
        message = None
    except DivergenceError as e:
        message = str(e)
    return {"message": message, "steps": opt.steps, "skipped": opt.skipped, "scale": opt.current_scale,
            "iterations": int(ops.convert_to_numpy(opt.iterations)),
            "unchanged": all(np.array_equal(a, b) for a, b in zip(before, _snapshot(model, opt)))}


def divergence_runs() -> dict:
    """A NaN loss on every step (bf16-mixed, 16-master; and bf16-mixed with a monitor attached), and a
    gradient overflow at a finite loss below scale 1 (``overflows_below=3``)."""
    out = {}
    nan_x, zeros = np.full((24, 4), np.nan, "float32"), np.zeros((24, 1), "float32")
    for recipe in ("bf16-mixed", "16-master"):
        keras_ext.set_global_policy(recipe)
        try:
            keras.utils.set_random_seed(0)
            model = keras_ext.apply_policy(keras.Sequential([keras.Input((4,)), keras.layers.Dense(3),
                                                             keras.layers.Dense(1)]))
            opt = keras_ext.master_optimizer(keras.optimizers.Adam(1e-2), recipe)
            model.compile(opt, "mse")
            opt.build(model.trainable_variables)
            monitor = keras_ext.MixedPrecisionMonitor(log_every_n_steps=1, log_memory=False)
            with_monitor = recipe == "bf16-mixed"
            out[recipe] = _stop(model, opt, nan_x, zeros, [monitor] if with_monitor else [])
            if with_monitor:
                out[recipe]["monitor_overflows"] = [s.step for s in monitor.history if s.overflow]
                out[recipe]["monitor_detached"] = opt.monitor is None
        finally:
            keras.config.set_dtype_policy("float32")
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), GradNaN(), keras.layers.Dense(1)])
    opt = keras_ext.LossScaleOptimizer(keras.optimizers.SGD(0.1), {"init_scale": 4.0},
                                       divergence={"overflows_below": 3})
    model.compile(opt, "mse")
    opt.build(model.trainable_variables)
    x = np.random.default_rng(0).normal(size=(24, 4)).astype("float32")
    out["overflow"] = _stop(model, opt, x, zeros)
    return out
