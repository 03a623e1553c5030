"""lightning_ext.MixedPrecisionMonitor: shared names in Lightning loggers, scaler series, meters,
attribution, auto-fallback, divergence guard, memory report, history export."""

import glob
import os

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_ext import MixedPrecision, MixedPrecisionMonitor
from lightning_ext.diagnostics import grad_underflow_fraction, underflow_limit, update_swamped_fraction
from mp_callbacks import History
from mp_callbacks.diagnostics import LOSS_SOURCE, METRICS, OVERFLOW_MODULE, DivergenceError, plot
from mp_callbacks.diagnostics import meters as ref
from mp_callbacks.policy import PrecisionPolicy
from tests.helpers.series import SCALER_SERIES, expected_series, read_csv_series
from tests.lightning.helpers.models import TinyRegressor, ddp_fork, loader, trainer_kwargs
from tests.lightning.helpers.monitor_models import (
    AMPLIFY_FP16,
    AmplifiedRegressor,
    OnesLinear,
    SpreadGrads,
    ones_loader,
    spread_loader,
)

NUMERIC = [m for m in METRICS if m != OVERFLOW_MODULE]


def _fit(model, plugin, monitor, max_steps, data=None, **kw):
    trainer = pl.Trainer(plugins=[plugin], max_steps=max_steps, callbacks=[monitor], **trainer_kwargs(**kw))
    trainer.fit(model, data if data is not None else loader())
    return trainer


# ------------------------------------------------------------------ meters vs NumPy
def test_torch_meters_equal_the_numpy_references():
    rng = np.random.default_rng(0)
    for _ in range(60):
        grads = [(rng.standard_normal(s) * np.exp2(rng.uniform(-150, 10, s))).astype(np.float32)
                 for s in [(64,), (9, 5)]]
        grads[0][:5] = 0
        compute = str(rng.choice(["float16", "bfloat16", "float32"]))
        scale = float(np.float32(rng.choice([2.0 ** int(rng.integers(-140, 120)), rng.uniform(0.1, 1e5)])))
        want = ref.grad_underflow_fraction(grads, compute, scale)
        got = grad_underflow_fraction([torch.from_numpy(g) for g in grads], compute, torch.tensor(scale))
        assert got == want
        weights = [(rng.standard_normal(s) * np.exp2(rng.uniform(-140, 20, s))).astype(np.float32)
                   for s in [(64,), (6, 4)]]
        updates = [(rng.standard_normal(w.shape) * np.abs(w) * np.exp2(rng.uniform(-30, 0, w.shape)))
                   .astype(np.float32) for w in weights]
        updates[0][:3] = 0
        storage = str(rng.choice(["float16", "bfloat16", "float32"]))
        assert update_swamped_fraction([torch.from_numpy(w) for w in weights], [torch.from_numpy(d) for d in updates],
                                       storage) == ref.update_swamped_fraction(weights, updates, storage)


def test_sampled_torch_meters_equal_the_sampled_references():
    rng = np.random.default_rng(2)
    g = (rng.standard_normal((300, 257)) * np.exp2(rng.uniform(-40, 0, (300, 257)))).astype(np.float32)
    w = rng.standard_normal((300, 257)).astype(np.float32)
    d = (w * np.exp2(rng.uniform(-30, 0, w.shape))).astype(np.float32)
    for samples in (1000, 4096, None):
        assert grad_underflow_fraction([torch.from_numpy(g)], "float16", 1.0, samples) == \
            ref.grad_underflow_fraction([g], "float16", 1.0, samples)
        assert update_swamped_fraction([torch.from_numpy(w)], [torch.from_numpy(d)], "bfloat16", samples) == \
            ref.update_swamped_fraction([w], [d], "bfloat16", samples)


@pytest.mark.parametrize("compute,scale", [("float16", 2.0**16), ("float16", 1000.0), ("bfloat16", 3.0),
                                           ("float16", 2.0**-20)])
def test_underflow_rule_is_exact_at_the_threshold(compute, scale):
    limit = float(underflow_limit(compute, scale))
    below = float(np.nextafter(np.float32(limit), np.float32(0)))
    grads = [np.array([limit, below, float(np.nextafter(np.float32(limit), np.float32(1))), 1.0], np.float32)]
    want = ref.grad_underflow_fraction(grads, compute, scale)
    assert grad_underflow_fraction([torch.from_numpy(grads[0])], compute, scale) == want


@pytest.mark.parametrize("storage", ["float16", "bfloat16", "float32"])
def test_swamping_rule_is_exact_at_half_an_ulp(storage):
    w = np.array([1.0, 1.0, 1.0, 3.0, 2.0**-20, 0.0], np.float32)
    h = ref.half_ulp(w, storage).astype(np.float32)
    d = np.array([h[0], np.nextafter(h[1], np.float32(0)), -h[2] * 2, h[3], h[4], h[5]], np.float32)
    want = ref.update_swamped_fraction([w], [d], storage)
    assert update_swamped_fraction([torch.from_numpy(w)], [torch.from_numpy(d)], storage) == want


# ------------------------------------------------------------------------ loggers
def test_shared_names_reach_csv_and_tensorboard(tmp_path):
    csv_logger = CSVLogger(tmp_path, name="csv")
    tb_logger = TensorBoardLogger(tmp_path, name="tb")
    monitor = MixedPrecisionMonitor(attribute_overflows=True, log_every_n_steps=2)
    plugin = MixedPrecision("16-mixed", scaler={"init_scale": 2.0**8, "growth_interval": 100})
    trainer = _fit(TinyRegressor(inf_steps={2}), plugin, monitor, 8, logger=[csv_logger, tb_logger])
    # every 2nd step logs everything; the overflow at step 3 (global step 2) is recorded too
    assert [s.step for s in monitor.history] == [2, 3, 4, 6, 8]
    assert monitor.history[1].overflow and monitor.history[1].overflow_module == LOSS_SOURCE
    import csv

    with open(os.path.join(csv_logger.log_dir, "metrics.csv")) as fh:
        rows = list(csv.DictReader(fh))
    header = set(rows[0])
    assert set(NUMERIC) <= header and OVERFLOW_MODULE not in header  # the module name is text, not a metric
    logged = [r for r in rows if r["mp/scale"] != ""]
    assert [int(r["step"]) for r in logged] == [2, 3, 4, 6, 8]
    assert [r["mp/overflow"] for r in logged] == ["0.0", "1.0", "0.0", "0.0", "0.0"]
    assert all(r["mp/update_swamped_frac"] == "" for r in logged if r["mp/overflow"] == "1.0")  # skipped: no update
    assert trainer.scaler.overflows == 1
    memory = [r for r in rows if r.get("mp/memory_bytes_per_param", "") != ""]
    assert [int(r["step"]) for r in memory] == [0, 8]  # train start and end

    assert glob.glob(os.path.join(tb_logger.log_dir, "events.out.tfevents.*"))
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(tb_logger.log_dir, size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    assert set(NUMERIC) <= set(events.Tags()["scalars"])
    assert [e.step for e in events.Scalars("mp/scale")] == [2, 3, 4, 6, 8]
    text = events.Tensors(f"{OVERFLOW_MODULE}/text_summary")
    assert [e.step for e in text] == [3]
    assert text[0].tensor_proto.string_val[0].decode() == LOSS_SOURCE


def test_requires_the_lightning_ext_plugin():
    trainer = pl.Trainer(precision="16-mixed", max_steps=1, callbacks=[MixedPrecisionMonitor(attribute_overflows=True)],
                         **trainer_kwargs())
    with pytest.raises(MisconfigurationException, match="lightning_ext.MixedPrecision"):
        trainer.fit(TinyRegressor(), loader())


# --------------------------------------------------------------- scaler series
def test_logged_series_equal_the_core_scaler(tmp_path):
    inf = {2, 3, 7, 8, 12}
    steps = 16
    monitor = MixedPrecisionMonitor(attribute_overflows=True, log_every_n_steps=1)
    plugin = MixedPrecision("16-mixed", scaler={"init_scale": 2.0**4, "growth_interval": 3})
    logger = CSVLogger(tmp_path)
    _fit(TinyRegressor(inf_steps=inf), plugin, monitor, steps, logger=logger)
    want = expected_series(plugin.recipe.scaler, [k in inf for k in range(steps)])
    got = read_csv_series(os.path.join(logger.log_dir, "metrics.csv"), SCALER_SERIES)
    assert got == want
    assert {n: monitor.history.series(n) for n in SCALER_SERIES} == {
        n: [type(v)(x) for v, x in zip(monitor.history.series(n), want[n])] for n in SCALER_SERIES}
    assert max(want["mp/growths_total"]) >= 2 and min(want["mp/scale"]) < 2.0**4  # both directions exercised


def test_no_host_sync_between_logging_steps(monkeypatch):
    """The monitor adds one read at train start and one per logging step, nothing else."""
    counts = {"n": 0}
    for name in ("item", "tolist", "__bool__", "__float__", "__int__", "__index__"):
        original = getattr(torch.Tensor, name)

        def wrapped(self, *a, _original=original, **k):
            counts["n"] += 1
            return _original(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, wrapped)

    def reads(monitor):
        counts["n"] = 0
        callbacks = [monitor] if monitor is not None else []
        plugin = MixedPrecision("16-mixed", scaler={"init_scale": 2.0**8})
        trainer = pl.Trainer(plugins=[plugin], max_steps=12, callbacks=callbacks, **trainer_kwargs())
        trainer.fit(TinyRegressor(), loader())
        return counts["n"]

    baseline = reads(None)
    with_monitor = reads(MixedPrecisionMonitor(attribute_overflows=True, log_every_n_steps=4, log_memory=False))
    assert with_monitor - baseline == 1 + 3  # train start + steps 4, 8, 12


# ------------------------------------------------------------------ attribution
def test_attribution_names_the_overflowing_module_and_checkpoints_keep_it(tmp_path):
    monitor = MixedPrecisionMonitor(attribute_overflows=True, log_every_n_steps=50)
    plugin = MixedPrecision("16-mixed", policy=AMPLIFY_FP16, scaler={"init_scale": 2.0**8})
    trainer = _fit(AmplifiedRegressor(), plugin, monitor, 3)
    assert [(s.step, s.overflow_module) for s in monitor.history] == [(1, "net.1"), (2, "net.1"), (3, "net.1")]
    overflow_events = [e for e in monitor.history.events if e["kind"] == "overflow"]
    assert overflow_events == [{"kind": "overflow", "step": k, "scale": 2.0 ** (9 - k), "module": "net.1"}
                               for k in (1, 2, 3)]
    path = tmp_path / "m.ckpt"
    trainer.save_checkpoint(path)
    ckpt = torch.load(path, weights_only=True)  # plain data only
    restored = MixedPrecisionMonitor(attribute_overflows=True)
    restored.load_state_dict(ckpt["callbacks"][monitor.state_key])
    assert [s.overflow_module for s in restored.history] == ["net.1"] * 3
    assert list(restored.history.events) == list(monitor.history.events)
    with pytest.raises(ValueError, match="schema"):
        restored.load_state_dict({"schema": "other"})


class _GradBoost(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return g * 1e6  # inf in fp16


class GradBoost(torch.nn.Module):
    """Identity forward, gradient times 1e6: overflows only in the backward pass."""

    def forward(self, x):
        return _GradBoost.apply(x)


def test_attribution_finds_a_module_whose_gradient_overflows():
    model = TinyRegressor()
    model.net = torch.nn.Sequential(torch.nn.Linear(8, 16), GradBoost(), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    policy = PrecisionPolicy(params="float32", compute="float16", output="float32",
                             module_rules=(("GradBoost", "float16"),))
    monitor = MixedPrecisionMonitor(attribute_overflows=True, log_every_n_steps=50)
    _fit(model, MixedPrecision("16-mixed", policy=policy, scaler={"init_scale": 2.0**8}), monitor, 2)
    assert [s.overflow_module for s in monitor.history] == ["net.1", "net.1"]


# ---------------------------------------------------------------- auto-fallback
def test_auto_fallback_moves_the_culprit_to_fp32_and_resume_keeps_it(tmp_path):
    monitor = MixedPrecisionMonitor(attribute_overflows=True, log_every_n_steps=50, auto_fallback_after=2)
    plugin = MixedPrecision("16-mixed", policy=AMPLIFY_FP16, scaler={"init_scale": 2.0**8, "growth_interval": 100})
    trainer = _fit(AmplifiedRegressor(), plugin, monitor, 6)
    assert [(s.step, s.overflow) for s in monitor.history] == [(1, True), (2, True)]  # then only clean steps
    assert trainer.scaler.overflows == 2 and trainer.scaler.steps == 6
    assert plugin.policy.module_rules[0] == ("net.1", "float32")
    assert [e for e in monitor.history.events if e["kind"] == "fallback"] == [
        {"kind": "fallback", "step": 2, "module": "net.1", "overflows": 2}]
    path = tmp_path / "fb.ckpt"
    trainer.save_checkpoint(path)
    # a fresh plugin (original policy) resumes: the restored monitor moves net.1 again before training
    monitor2 = MixedPrecisionMonitor(attribute_overflows=True, log_every_n_steps=50, auto_fallback_after=2)
    plugin2 = MixedPrecision("16-mixed", policy=AMPLIFY_FP16, scaler={"init_scale": 2.0**8, "growth_interval": 100})
    trainer2 = pl.Trainer(plugins=[plugin2], max_steps=10, callbacks=[monitor2], **trainer_kwargs())
    trainer2.fit(AmplifiedRegressor(), loader(), ckpt_path=path)
    assert plugin2.policy.module_rules[0] == ("net.1", "float32")
    assert trainer2.scaler.overflows == 2 and trainer2.scaler.steps == 10
    assert monitor2.step == 10 and len(monitor2.history) == 2


def test_keep_in_fp32_under_master_weights_restores_fp32_storage():
    model = TinyRegressor()
    plugin = MixedPrecision("16-master", scaler={"init_scale": 2.0**8})

    class MoveAtStep2(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step == 2:
                plugin.keep_in_fp32("net.0")

    trainer = pl.Trainer(plugins=[plugin], max_steps=5, callbacks=[MoveAtStep2()], **trainer_kwargs())
    trainer.fit(model, loader())
    assert model.net[0].weight.dtype == torch.float32 and model.net[2].weight.dtype == torch.float16
    masters = plugin.master_state_dict()
    assert torch.equal(masters["net.0.weight"], model.net[0].weight.detach())  # still driven by its master
    assert trainer.scaler.skipped == 0 and all(torch.isfinite(p).all() for p in model.parameters())


# ---------------------------------------------------------------- divergence
def test_divergence_guard_stops_with_scale_module_step_and_checklist():
    monitor = MixedPrecisionMonitor(attribute_overflows=True, log_every_n_steps=50, divergence_patience=3)
    plugin = MixedPrecision("16-mixed", policy=AMPLIFY_FP16, divergence=False,  # the floor guard alone
                            scaler={"init_scale": 4.0, "min_scale": 1.0, "growth_interval": 100})
    with pytest.raises(DivergenceError) as info:
        _fit(AmplifiedRegressor(), plugin, monitor, 20)
    message = str(info.value)
    for part in ("scale=1", "min_scale=1", "up to step 5", "'net.1'", "lower the learning rate",
                 "with_fp32_modules"):
        assert part in message, part
    assert [s.scale for s in monitor.history] == [4.0, 2.0, 1.0, 1.0, 1.0]


# ---------------------------------------------------------------- meters in training
@pytest.mark.parametrize("recipe,expected", [("bf16-master", 1.0), ("16-mixed", 1.0), ("32-true", 0.0)])
def test_update_swamping_fraction(recipe, expected):
    """lr * grad = 1e-5 on weights of 1.0: lost in bf16/fp16 storage (half ulp 2**-8 / 2**-11), kept in FP32."""
    monitor = MixedPrecisionMonitor(attribute_overflows=True, log_every_n_steps=1)
    model = OnesLinear(lr=1e-5)
    scaler = {"init_scale": 2.0**8} if recipe == "16-mixed" else None  # 2**16 * grad 1 overflows fp16
    plugin = MixedPrecision(recipe, scaler=scaler)
    _fit(model, plugin, monitor, 3, data=ones_loader())
    assert monitor.history.series("update_swamped_frac") == [expected] * 3
    if recipe == "bf16-master":  # the masters kept what the bf16 weights lost
        assert torch.all(model.lin.weight == 1.0)
        master = plugin.master_state_dict()["lin.weight"]
        assert master.dtype == torch.float32 and torch.all(master < 1.0)
        # three SGD updates of lr * grad = 1e-5 each, accumulated in FP32
        assert torch.allclose(1.0 - master, torch.full_like(master, 3e-5), rtol=0.05)


def test_underflow_fraction_rises_as_the_scale_drops():
    monitor = MixedPrecisionMonitor(attribute_overflows=True, log_every_n_steps=1)
    plugin = MixedPrecision("16-mixed", scaler={"init_scale": 2.0**16, "backoff_factor": 2.0**-8,
                                                "growth_interval": 1000})
    model = SpreadGrads(inf_steps={1, 3, 5})
    _fit(model, plugin, monitor, 8, data=spread_loader())
    clean = [s for s in monitor.history if not s.overflow]
    assert [s.scale for s in clean] == [2.0**16, 2.0**8, 1.0, 2.0**-8, 2.0**-8]
    fractions = [s.grad_underflow_frac for s in clean]
    assert fractions == sorted(fractions) and fractions[0] < fractions[1] < fractions[2] < fractions[3]
    x = (10.0 ** (-np.arange(17) / 2)).astype(np.float32)
    want = [ref.grad_underflow_fraction([np.float32(1e-4) * x], "float16", s.scale) for s in clean]
    assert fractions == want


# ---------------------------------------------------------------- memory, export
def test_memory_report_counts_real_tensors_next_to_the_estimate():
    monitor = MixedPrecisionMonitor(attribute_overflows=True, log_every_n_steps=50)
    model = TinyRegressor()
    trainer = _fit(model, MixedPrecision("bf16-master"), monitor, 3)
    start, end = monitor.memory_reports
    n = sum(p.numel() for p in model.parameters())
    tensors = len(list(model.parameters()))
    assert start["when"] == "train_start" and end["when"] == "train_end"
    # At the step: FP32 grads + FP32 masters + Adam m, v; the bf16 weights released
    assert (end["estimate"]["grads"], end["estimate"]["masters"], end["estimate"]["optimizer_state"],
            end["estimate"]["weights"]) == (4 * n, 4 * n, 8 * n, 0)
    assert end["estimate"]["bytes_per_param"] == 16.0
    actual = end["actual"]
    # After the step: bf16 weights, no grads (bf16 ones moved to the masters, FP32 ones dropped after the
    # update), FP32 masters, Adam m/v (scalar step counters are bookkeeping, not state)
    assert (actual["weights"], actual["grads"], actual["masters"]) == (2 * n, 0, 4 * n)
    assert actual["optimizer_state"] == 8 * n and tensors > 1
    assert start["actual"]["grads"] == 0 and start["actual"]["optimizer_state"] == 0
    assert monitor.memory_report(trainer)["actual"] == actual


def test_history_plot_and_jsonl_round_trip(tmp_path):
    monitor = MixedPrecisionMonitor(attribute_overflows=True, log_every_n_steps=1)
    plugin = MixedPrecision("16-mixed", scaler={"init_scale": 2.0**8, "growth_interval": 2})
    _fit(TinyRegressor(inf_steps={1, 4}), plugin, monitor, 6)
    png = tmp_path / "scale.png"
    plot(monitor.history, png, title="16-mixed")
    assert png.stat().st_size > 1000
    jsonl = tmp_path / "h.jsonl"
    monitor.history.to_jsonl(jsonl)
    back = History.from_jsonl(jsonl)
    assert [s.to_dict() for s in back] == [s.to_dict() for s in monitor.history]
    assert list(back.events) == list(monitor.history.events)
    assert [s.overflow for s in back] == [False, True, False, False, True, False]


def test_accumulation_and_manual_optimization_count_optimizer_steps():
    """One record per scaler transition: accumulated micro-batches are one step; two optimizers are two."""
    monitor = MixedPrecisionMonitor(attribute_overflows=True, log_every_n_steps=1)
    plugin = MixedPrecision("16-mixed", scaler={"init_scale": 2.0**8})
    _fit(TinyRegressor(inf_steps={1}), plugin, monitor, 4, accumulate_grad_batches=2)
    assert [(s.step, s.overflow) for s in monitor.history] == [(1, False), (2, True), (3, False), (4, False)]

    from tests.lightning.test_skip_semantics import TwoOptimizers

    monitor = MixedPrecisionMonitor(attribute_overflows=True, log_every_n_steps=1)
    plugin = MixedPrecision("16-mixed", scaler={"init_scale": 2.0**8})
    _fit(TwoOptimizers(), plugin, monitor, 6)
    # batch 1's generator step (the 3rd transition) had an inf loss; the discriminator's step is clean
    assert [s.overflow for s in monitor.history] == [False, False, True, False, False, False]
    assert monitor.history[2].overflow_module == LOSS_SOURCE
    assert monitor.history[2].update_swamped_frac is None and monitor.history[3].update_swamped_frac is not None


def test_without_loss_scaling_overflows_are_skipped_and_recorded():
    """bf16 (no scaling): the non-finite step is skipped like under fp16, and recorded at once."""
    monitor = MixedPrecisionMonitor(attribute_overflows=True, log_every_n_steps=2)
    _fit(TinyRegressor(inf_steps={1}), MixedPrecision("bf16-mixed"), monitor, 4)
    rows = [(s.step, s.overflow, s.overflows_total, s.skipped_total, s.overflow_module) for s in monitor.history]
    assert rows == [(2, True, 1, 1, LOSS_SOURCE), (4, False, 1, 1, None)]


def test_opted_out_overflows_are_seen_on_logging_steps():
    """skip_nonfinite=False: no per-step read, so overflows show up at the next logging step."""
    monitor = MixedPrecisionMonitor(attribute_overflows=True, log_every_n_steps=2)
    plugin = MixedPrecision("bf16-mixed", scaler={"enabled": False, "skip_nonfinite": False}, divergence=False)
    _fit(TinyRegressor(inf_steps={1}), plugin, monitor, 4)
    rows = [(s.step, s.overflow, s.overflows_total, s.skipped_total, s.overflow_module) for s in monitor.history]
    # step 2 applied a non-finite update, so step 4's forward is already NaN in net.0
    assert rows == [(2, True, 1, 0, LOSS_SOURCE), (4, True, 3, 0, "net.0")]


@pytest.mark.multiprocess
def test_ddp_ranks_blame_and_move_the_same_module(tmp_path):
    """net.1 overflows on rank 1 only: both ranks blame it and both move it to FP32.

    Rank 0 finds no local culprit (its grads turn NaN only in DDP's all-reduce) and takes rank 1's.
    """
    from tests.lightning.helpers.monitor_models import SaveMonitorState

    monitor = MixedPrecisionMonitor(attribute_overflows=True, log_every_n_steps=50, auto_fallback_after=2)
    trainer = pl.Trainer(
        plugins=[MixedPrecision("16-mixed", policy=AMPLIFY_FP16, scaler={"init_scale": 2.0**8})],
        strategy=ddp_fork(), max_steps=5, callbacks=[monitor, SaveMonitorState(str(tmp_path), monitor)],
        **trainer_kwargs(devices=2),
    )
    trainer.fit(AmplifiedRegressor(only_rank=1), loader(n=128))
    ranks = [torch.load(tmp_path / f"monitor_rank{r}.pt", weights_only=True) for r in (0, 1)]
    for r in ranks:
        assert r["modules"] == ["net.1", "net.1"]
        assert r["events"] == ["overflow", "overflow", "fallback"]
        assert r["rules"][0] == ["net.1", "float32"] and r["overflows"] == 2
    for name, value in ranks[0]["params"].items():
        assert torch.equal(value, ranks[1]["params"][name]), name


class _RaisesAtStep(TinyRegressor):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if self.trainer.global_step == 2:
            raise RuntimeError("boom in training_step")
        return loss


def test_a_failing_run_leaves_no_hooks_behind():
    model = _RaisesAtStep()
    monitor = MixedPrecisionMonitor(attribute_overflows=True, log_every_n_steps=1)
    with pytest.raises(RuntimeError, match="boom in training_step"):
        _fit(model, MixedPrecision("16-mixed"), monitor, 5)
    assert len(monitor.history) == 2
    assert not monitor.tracer.active and not monitor.tracer._handles and not monitor.tracer.records
    assert monitor._pending is None
    for sub in model.modules():
        assert not sub._forward_hooks and not sub._forward_pre_hooks
    for p in model.parameters():
        assert not p._backward_hooks
