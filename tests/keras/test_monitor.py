"""keras_ext/diagnostics/monitor.py: shared names in Keras logs / History / CSVLogger / TensorBoard, scaler
series, meters in training, auto-fallback, divergence guard, memory report, state and history export
(the twin of tests/lightning/test_monitor.py)."""

import csv
import glob
import json
import os

import keras
import numpy as np
import pytest
from keras import ops

import keras_ext
from keras_ext import MixedPrecisionMonitor
from mp_callbacks import History, estimate_memory, get_recipe
from mp_callbacks.diagnostics import LOSS_SOURCE, METRICS, OVERFLOW_MODULE, DivergenceError, plot
from mp_callbacks.diagnostics import meters as ref
from tests.helpers.series import SCALER_SERIES, expected_series, series_from_rows
from tests.keras.helpers.models import (
    Amplify,
    RecordLogs,
    compile_scaled,
    fit,
    mean_output,
    ones_linear,
    spread_inputs,
    tiny_regressor,
)
from tests.keras.helpers.util import requires_tf_backend, run_script

NUMERIC = [m for m in METRICS if m != OVERFLOW_MODULE]
METERS = ("mp/grad_norm", "mp/grad_underflow_frac", "mp/update_swamped_frac")

# Amplify's constant 1e6 becomes inf when TensorFlow converts it to float16: that is the point.
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")


def test_shared_names_reach_logs_history_csv_and_tensorboard(tmp_path):
    keras.config.set_dtype_policy("mixed_float16")
    model = tiny_regressor()
    compile_scaled(model, {"init_scale": 2.0**8, "growth_interval": 100})
    monitor = MixedPrecisionMonitor(attribute_overflows=True, log_every_n_steps=2)
    rec = RecordLogs()
    csv_path = tmp_path / "log.csv"
    tb_dir = tmp_path / "tb"
    history = fit(model, monitor, 8, inf_steps={2}, epochs=2,
                  callbacks=[rec, keras.callbacks.CSVLogger(str(csv_path)),
                             keras.callbacks.TensorBoard(str(tb_dir), update_freq=1)])
    # every 2nd step is logged; the overflows at steps 3 and 11 (batch 2 of each epoch) are recorded from
    # the device buffer at the next logging step's read
    steps = [s.step for s in monitor.history]
    assert steps == [2, 3, 4, 6, 8, 10, 11, 12, 14, 16]
    assert monitor.history[1].overflow and monitor.history[1].overflow_module == LOSS_SOURCE
    assert monitor.history[1].update_swamped_frac is None and monitor.history[2].update_swamped_frac is not None
    logged = [r for r in rec.rows if "mp/scale" in r]
    assert len(logged) == 8 and set(NUMERIC) <= set(logged[0]) and OVERFLOW_MODULE not in logged[0]
    assert [r["mp/overflows_total"] for r in logged] == [0.0] + [1.0] * 4 + [2.0] * 3
    assert set(NUMERIC) <= set(history.history) and len(history.history["mp/scale"]) == 2
    assert history.history["mp/skipped_total"] == [1.0, 2.0]
    assert "mp/memory_bytes_per_param" in history.history
    with open(csv_path) as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == 2 and set(NUMERIC) <= set(rows[0]) and float(rows[1]["mp/overflows_total"]) == 2.0
    files = glob.glob(os.path.join(tb_dir, "train", "events.out.tfevents.*"))
    assert files
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(os.path.dirname(files[0]), size_guidance={"tensors": 0, "scalars": 0})
    events.Reload()
    tags = set(events.Tags()["tensors"]) | set(events.Tags()["scalars"])
    assert {"batch_mp/scale", "epoch_mp/scale", "epoch_mp/update_swamped_frac"} <= tags
    assert [e.step for e in events.Tensors("batch_mp/scale")] == [2, 4, 6, 8, 10, 12, 14, 16]


def test_requires_the_keras_ext_optimizer():
    model = tiny_regressor()
    model.compile(keras.optimizers.SGD(), "mse")
    with pytest.raises(TypeError, match="keras_ext.LossScaleOptimizer"):
        fit(model, MixedPrecisionMonitor(attribute_overflows=True), 2)


def test_logged_series_equal_the_core_scaler():
    keras.config.set_dtype_policy("mixed_float16")
    inf, steps = {2, 3, 7, 8, 12}, 16
    model = tiny_regressor()
    opt = compile_scaled(model, {"init_scale": 2.0**4, "growth_interval": 3})
    monitor = MixedPrecisionMonitor(attribute_overflows=True, log_every_n_steps=1)
    rec = RecordLogs()
    fit(model, monitor, steps, inf_steps=inf, callbacks=[rec])
    want = expected_series(opt.scaler_config, [k in inf for k in range(steps)])
    assert series_from_rows(rec.rows) == want  # what reached the Keras logs
    assert {n: [float(v) for v in monitor.history.series(n)] for n in SCALER_SERIES} == want
    assert [s.step for s in monitor.history] == list(range(1, steps + 1))
    assert max(want["mp/growths_total"]) >= 2 and min(want["mp/scale"]) < 2.0**4  # both directions exercised


def test_reads_only_on_logging_steps_epoch_and_train_end(monkeypatch):
    """Every device-to-host read of the fit (keras.ops.convert_to_numpy, TF's EagerTensor.numpy) happens at
    steps 4, 8, 12, the epoch end and the train end; with the divergence rule off (its latch is one scalar
    read per step), nothing is read in between."""
    reads = []
    monitor = MixedPrecisionMonitor(attribute_overflows=True, log_every_n_steps=4, log_memory=False)

    def counting(original):
        def wrapper(*args, **kwargs):
            reads.append(monitor.step)
            return original(*args, **kwargs)
        return wrapper

    model = tiny_regressor()
    compile_scaled(model, {"init_scale": 2.0**8}, divergence=False)
    monkeypatch.setattr(keras.ops, "convert_to_numpy", counting(keras.ops.convert_to_numpy))
    if keras.backend.backend() == "tensorflow":
        from tensorflow.python.framework import ops as tf_ops

        monkeypatch.setattr(tf_ops._EagerTensorBase, "numpy", counting(tf_ops._EagerTensorBase.numpy))
    fit(model, monitor, 12, inf_steps={5})
    assert set(reads) == {0, 4, 8, 12}  # 0: train start (the optimizer's counters), then logging steps only
    assert [(s.step, s.overflow) for s in monitor.history] == [(4, False), (6, True), (8, False), (12, False)]


@requires_tf_backend
def test_auto_fallback_moves_the_culprit_to_fp32_and_a_resume_keeps_it(tmp_path):
    keras.config.set_dtype_policy("mixed_float16")
    state = tmp_path / "monitor.json"
    model = tiny_regressor(middle=Amplify(name="amplify"))
    opt = compile_scaled(model, {"init_scale": 2.0**8, "growth_interval": 100})
    monitor = MixedPrecisionMonitor(attribute_overflows=True, log_every_n_steps=1, auto_fallback_after=2,
                                    state_path=state)
    fit(model, monitor, 6)
    assert [s.overflow for s in monitor.history] == [True, True, False, False, False, False]
    assert opt.overflows == 2 and opt.steps == 6
    assert model.get_layer("amplify").dtype_policy.name == "float32"
    assert [e for e in monitor.history.events if e["kind"] == "fallback"] == [
        {"kind": "fallback", "step": 2, "module": "amplify", "overflows": 2}]
    assert "amplify" in monitor.fallback_messages[0]
    # a fresh model (float16 again) and a fresh monitor reading the state file: amplify moves before training
    model2 = tiny_regressor(middle=Amplify(name="amplify"))
    opt2 = compile_scaled(model2, {"init_scale": 2.0**8, "growth_interval": 100})
    monitor2 = MixedPrecisionMonitor(attribute_overflows=True, log_every_n_steps=1, auto_fallback_after=2,
                                     state_path=state)
    fit(model2, monitor2, 4)
    assert model2.get_layer("amplify").dtype_policy.name == "float32"
    assert opt2.overflows == 0 and len(monitor2.history) == 6 + 4


@requires_tf_backend
def test_divergence_guard_stops_with_scale_layer_step_and_checklist():
    keras.config.set_dtype_policy("mixed_float16")
    model = tiny_regressor(middle=Amplify(name="amplify"))
    compile_scaled(model, {"init_scale": 4.0, "min_scale": 1.0, "growth_interval": 100},
                   divergence=False)  # the floor guard alone (the optimizer's rule would stop first)
    monitor = MixedPrecisionMonitor(attribute_overflows=True, log_every_n_steps=50, divergence_patience=3)
    with pytest.raises(DivergenceError) as info:
        fit(model, monitor, 8, epochs=3)  # the rows are read at the first epoch end
    message = str(info.value)
    for part in ("scale=1", "min_scale=1", "up to step 5", "'amplify'", "lower the learning rate",
                 "with_fp32_modules"):
        assert part in message, part
    assert [s.scale for s in monitor.history] == [4.0, 2.0, 1.0, 1.0, 1.0]
    assert "train_step" not in model.__dict__  # hooks removed before raising


@pytest.mark.parametrize("recipe,expected", [("bf16-master", 1.0), ("16-mixed", 1.0), ("32-true", 0.0)])
def test_update_swamping_fraction(recipe, expected):
    """lr * grad = 1e-5 on weights of 1.0: lost in bf16/fp16 storage (half ulp 2**-8 / 2**-11), kept in FP32."""
    keras_ext.set_global_policy(recipe)
    model = ones_linear(dtype="bfloat16" if recipe == "bf16-master" else None)  # new layers store FP32
    scaler = {"init_scale": 2.0**8} if recipe == "16-mixed" else None
    opt = keras_ext.master_optimizer(keras.optimizers.SGD(1e-5), recipe, scaler=scaler)
    model.compile(opt, mean_output, jit_compile=False)
    monitor = MixedPrecisionMonitor(attribute_overflows=True, log_every_n_steps=1)
    x = np.ones((12, 64), "float32")
    model.fit(x, np.zeros((12, 1), "float32"), batch_size=4, shuffle=False, verbose=0, callbacks=[monitor])
    assert monitor.history.series("update_swamped_frac") == [expected] * 3
    if recipe == "bf16-master":  # the masters kept what the bf16 weights lost
        assert np.all(ops.convert_to_numpy(model.weights[0]).astype("float32") == 1.0)
        assert np.all(ops.convert_to_numpy(opt.master_variables[0]) < 1.0)


def test_underflow_fraction_rises_as_the_scale_drops():
    keras.config.set_dtype_policy("mixed_float16")
    model = ones_linear(17, dtype="float32")  # a FP32 layer: its gradients never pass through fp16
    opt = keras_ext.LossScaleOptimizer(keras.optimizers.SGD(1e-3), {"init_scale": 2.0**16, "backoff_factor": 2.0**-8,
                                                                     "growth_interval": 1000})
    model.compile(opt, lambda y, p: ops.sum(p, axis=-1) * 1e-4, jit_compile=False)
    monitor = MixedPrecisionMonitor(attribute_overflows=True, log_every_n_steps=1)
    x, y = spread_inputs()
    w = np.ones(len(x), "float32")
    w[[1, 3, 5]] = np.inf
    model.fit(x, y, sample_weight=w, batch_size=1, shuffle=False, verbose=0, callbacks=[monitor])
    clean = [s for s in monitor.history if not s.overflow]
    assert [s.scale for s in clean] == [2.0**16, 2.0**8, 1.0, 2.0**-8, 2.0**-8]
    fractions = [s.grad_underflow_frac for s in clean]
    assert fractions[0] < fractions[1] < fractions[2] < fractions[3] == fractions[4]
    want = [ref.grad_underflow_fraction([np.float32(1e-4) * x[0]], "float16", s.scale) for s in clean]
    assert fractions == want


def test_memory_report_counts_real_variables_next_to_the_estimate():
    keras.config.set_dtype_policy("bfloat16")  # Keras' own policy: every layer stores bf16 (no per-layer rules)
    model = tiny_regressor()
    opt = keras_ext.master_optimizer(keras.optimizers.Adam(1e-3), "bf16-master")
    model.compile(opt, "mse", jit_compile=False)
    monitor = MixedPrecisionMonitor(attribute_overflows=True, log_every_n_steps=50)
    fit(model, monitor, 3)
    start, end = monitor.memory_reports
    n = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
    assert start["when"] == "train_start" and end["when"] == "train_end"
    assert end["estimate"] == estimate_memory(get_recipe("bf16-master").master, "adam", n,
                                           fp32_master_grads=True).to_dict()
    # The step widens the whole gradient list to FP32 before the inner optimizer (the monitor reads it too).
    actual = end["actual"]
    assert (actual["weights"], actual["grads"], actual["masters"]) == (2 * n, 4 * n, 4 * n)
    slots = sum(int(np.prod(v.shape)) * 4 for v in opt.inner_optimizer.variables if len(v.shape))
    assert slots == 8 * n and actual["optimizer_state"] >= slots  # m, v (+ iteration count, learning rate)
    after = monitor.memory_report()  # detached: the same step (the whole list widened before the update)
    assert after["estimate"] == end["estimate"]
    assert after["actual"]["grads"] == 4 * n and after["actual"]["total"] == after["estimate"]["total"]


def test_history_plot_and_jsonl_round_trip(tmp_path):
    model = tiny_regressor()
    compile_scaled(model, {"init_scale": 2.0**8, "growth_interval": 2})
    monitor = MixedPrecisionMonitor(attribute_overflows=True, log_every_n_steps=1)
    fit(model, monitor, 6, inf_steps={1, 4})
    png = tmp_path / "scale.png"
    plot(monitor.history, png, title="keras 16-mixed")
    assert png.stat().st_size > 1000
    jsonl = tmp_path / "h.jsonl"
    monitor.history.to_jsonl(jsonl)
    back = History.from_jsonl(jsonl)
    assert [s.to_dict() for s in back] == [s.to_dict() for s in monitor.history]
    assert list(back.events) == json.loads(json.dumps(list(monitor.history.events)))
    assert [s.overflow for s in back] == [False, True, False, False, True, False]


def test_monitor_on_the_torch_backend():
    """Series, attribution (forward probes, no input-gradient identities) and fallback with KERAS_BACKEND=torch."""
    pytest.importorskip("torch")
    done = run_script("monitor_backend", env={"KERAS_BACKEND": "torch"})
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result == {"backend": "torch", "series_ok": True, "modules": [LOSS_SOURCE] * 3,
                      "fallback": ["amplify", "amplify"], "policy": "float32", "overflows": 2}


class _RaiseAtBatch(keras.callbacks.Callback):
    def __init__(self, batch):
        super().__init__()
        self.batch = batch

    def on_train_batch_end(self, batch, logs=None):
        if batch == self.batch:
            raise RuntimeError("boom in a callback")


def _patched(model):
    return [x.name for x in [model, *model._flatten_layers(include_self=False)]
            if {"call", "train_step", "_compute_loss"} & set(x.__dict__)]


def test_a_failing_fit_leaves_nothing_behind_after_uninstall_or_the_next_fit():
    model = tiny_regressor()
    opt = compile_scaled(model, {"init_scale": 2.0**8})
    monitor = MixedPrecisionMonitor(attribute_overflows=True, log_every_n_steps=1)
    with pytest.raises(RuntimeError, match="boom in a callback"):
        fit(model, monitor, 4, callbacks=[_RaiseAtBatch(1)])
    monitor.uninstall()
    assert _patched(model) == [] and opt.monitor is None
    monitor.uninstall()  # idempotent
    with pytest.raises(RuntimeError, match="boom in a callback"):
        fit(model, monitor, 4, callbacks=[_RaiseAtBatch(1)])
    fit(model, monitor, 4)  # train start removes what the failed fit left, then installs once
    assert _patched(model) == [] and opt.monitor is None
    assert [s.step for s in monitor.history][-4:] == [5, 6, 7, 8]


def test_epoch_logs_carry_the_last_logged_meter_values_never_nan():
    """Epochs of 6 steps, logging every 4th: epoch 1 ends on step 6 (not a logging step), so its meters
    are step 4's; epoch 2 ends on the logging step 12."""
    model = tiny_regressor()
    compile_scaled(model, {"init_scale": 2.0**8})
    monitor = MixedPrecisionMonitor(log_every_n_steps=4, log_memory=False)
    rec = RecordLogs()
    history = fit(model, monitor, 6, epochs=2, callbacks=[rec])
    logged = {s.step: s.metrics() for s in monitor.history}
    assert sorted(logged) == [4, 8, 12]
    for name in METERS:
        assert history.history[name] == [logged[4][name], logged[12][name]], name
        assert all(np.isfinite(history.history[name])), name
    assert history.history["mp/scale"] == [2.0**8, 2.0**8]
    assert all(np.isfinite(v).all() for k, v in history.history.items() if k.startswith("mp/"))


def test_epoch_logs_leave_out_meters_never_logged():
    model = tiny_regressor()
    compile_scaled(model, {"init_scale": 2.0**8})
    history = fit(model, MixedPrecisionMonitor(log_every_n_steps=50, log_memory=False), 3)
    assert not set(METERS) & set(history.history)
    assert history.history["mp/scale"] == [2.0**8] and history.history["mp/overflows_total"] == [0.0]
