"""``lightning_ext.MixedPrecisionMonitor``: the core's diagnostics as a Lightning callback.

A thin translation: :class:`~mp_callbacks.diagnostics.monitor.MonitorCore` decides the
cadence, keeps the :class:`~mp_callbacks.diagnostics.metrics.History`, records
overflow attributions, runs the divergence guard and the auto-fallback
tracker; this callback gathers the numbers from torch and
:class:`lightning_ext.MixedPrecision`, and writes the shared metric names
(:data:`mp_callbacks.diagnostics.metrics.METRICS`) to every Lightning logger with
``logger.log_metrics`` (CSVLogger, TensorBoardLogger...).
``mp/overflow_module`` is text: it goes to the history, to the checkpoint and
to loggers that take text (TensorBoard's ``add_text``), never to a metric.

Step numbering: one step per scaler transition (optimizer steps that ran a
backward), 1-based, continuing across resumes (read from the plugin's
counter once at train start).  Loggers get ``step=`` this number.
``mp/scale`` is the scale the step's gradients were produced with, the
counters are the totals after the step (see :mod:`mp_callbacks.diagnostics.attribution`).

Host syncs (the point of the design):

* per step, when the step is neither a logging step nor an overflow: **none**.
  The overflow is known from :meth:`MixedPrecision.last_step_skipped`, the
  host bool the plugin already read for its skip decision.  Overflow
  attribution only queues tiny device reductions (one ``isfinite().all()``
  per module output, input gradient and parameter gradient).  With loss
  scaling off (``bf16-*``, ``32-true``) nothing is skipped, so overflows are
  seen on logging steps only (the counters stay exact).
* logging steps (every ``log_every_n_steps``): one read of a stacked vector
  (scale, overflow, counters, grad norm, meter counts, loss).  The meters are
  queued in ``on_before_optimizer_step`` (unscaled FP32 grads, before
  clipping) and the parameters (FP32 masters under ``*-master``) are
  snapshotted there to diff after the step (one extra parameter copy on
  logging steps only).
* overflow steps: the same read, plus one read of the attribution flags
  (under DDP the ranks then exchange their local culprits, one small
  ``all_gather_object``, so every rank blames the same module).
* train start / end: the plugin's step counter (start) and the memory report
  (tensor sizes: metadata, no sync).
* ``fp8-mixed``: on logging steps the FP8 matmuls also count their saturated
  and flushed elements, and one more read gets the ``mp/fp8_*`` metrics
  (:meth:`lightning_ext.fp8.TorchFP8.host_metrics`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import Tensor

from mp_callbacks.diagnostics.meters import METER_SAMPLES
from mp_callbacks.diagnostics.metrics import OVERFLOW_MODULE, StepStats, memory_metrics
from mp_callbacks.diagnostics.monitor import MONITOR_SCHEMA_VERSION, MonitorFacade, PackedLayout  # version: re-exported

from .attribution import OverflowTracer, blame
from .memory import memory_report, optimizer_params, storage_dtypes
from .meters import grad_norm, sample, swamped_counts, underflow_counts
from .plugin import MixedPrecision
from .policy import policy_report

__all__ = ["MONITOR_SCHEMA", "MONITOR_SCHEMA_VERSION", "MixedPrecisionMonitor"]

MONITOR_SCHEMA = "lightning_ext.MixedPrecisionMonitor"
"""The ``schema`` tag of the callback's checkpoint record."""


@dataclass
class _Pending:
    """An optimizer step seen in ``on_before_optimizer_step``, finalized once the plugin has decided it."""

    optimizer: Any
    state: Any
    cut: int
    logging: bool
    grad_norm: Tensor | None = None
    underflow: tuple[Tensor, Tensor] | None = None
    before: list[tuple[Tensor, Tensor]] = field(default_factory=list)


class MixedPrecisionMonitor(MonitorFacade, Callback):
    """Mixed-precision diagnostics for :class:`lightning_ext.MixedPrecision`, with the shared metric names.

    Args:
      log_every_n_steps: log a full record (all shared metrics) every N steps;
        overflow steps are always recorded.  Between logging steps no host
        sync is added (see the module docstring).
      divergence_patience: raise :class:`~mp_callbacks.diagnostics.meters.DivergenceError`
        after this many consecutive overflows with the scale at its floor
        (None: never).  The message names the scale, the step, the first
        non-finite module and a checklist.
      auto_fallback_after: after this many overflows blamed on the same module,
        move it to FP32 with :meth:`MixedPrecision.keep_in_fp32` (None: never).
      attribute_overflows: name the first non-finite module on overflow steps
        (forward hooks + gradient hooks queue one device reduction per module
        output and gradient every step: 5-50% slower steps on small models).
        Default None: on exactly when ``auto_fallback_after`` is set.
      measure_grads: compute ``mp/grad_norm`` and ``mp/grad_underflow_frac`` on logging steps.
      measure_swamping: compute ``mp/update_swamped_frac`` on logging steps
        (snapshots the optimizer's parameters before the step).
      meter_samples: elements per tensor that the underflow and swamping
        meters read (a strided sample, :func:`mp_callbacks.diagnostics.meters.sample_stride`),
        which bounds a logging step's cost per tensor; ``None`` reads every element.
        ``mp/grad_norm`` always reads every element.
      log_memory: log :meth:`memory_report` at train start and end.
      history_maxlen: records kept in :attr:`history`.
      report_policy: at train start, print (and keep as a ``"policy"`` history
        event) what the policy decided per module (:func:`~lightning_ext.policy.policy_report`).

    While attached, the monitor turns on the plugin's per-step overflow check
    for recipes without loss scaling (``mp/overflow``, ``mp/overflows_total``
    count inf/NaN gradients there too; see
    :func:`mp_callbacks.loss_scale.scaler.checks_overflow`): one pass over the gradients
    per step, the monitor's main per-step cost under bf16 recipes.

    ``mp/update_swamped_frac`` measures the applied update of every optimizer
    parameter (the FP32 master under ``*-master``; under ``bf16-kahan`` and
    ``bf16-sr`` the optimizer's FP32 update before the rounding rule writes
    it into the bf16 weight) against the dtype chosen by
    :func:`~mp_callbacks.diagnostics.attribution.swamp_storage_dtype`: the actual
    low-precision storage under ``*-master``, the policy's compute dtype under
    ``*-mixed`` (float32 for modules the policy keeps in FP32); skipped steps
    have no update and log no value.

    Example::

        monitor = MixedPrecisionMonitor(log_every_n_steps=50, auto_fallback_after=3)
        Trainer(plugins=[MixedPrecision("16-mixed", "cuda")], callbacks=[monitor],
                logger=CSVLogger("logs"))
        monitor.history.to_jsonl("mp.jsonl")
    """

    SCHEMA = MONITOR_SCHEMA
    STATE_WORD = "checkpoint"

    def __init__(self, log_every_n_steps: int = 50, divergence_patience: int | None = None,
                 auto_fallback_after: int | None = None, attribute_overflows: bool | None = None,
                 measure_grads: bool = True, measure_swamping: bool = True, log_memory: bool = True,
                 history_maxlen: int = 100_000, meter_samples: int | None = METER_SAMPLES,
                 report_policy: bool = False) -> None:
        self._setup(log_every_n_steps, divergence_patience, auto_fallback_after, attribute_overflows,
                    measure_grads, measure_swamping, log_memory, history_maxlen, meter_samples, report_policy)
        self.tracer = OverflowTracer()
        self._pending: _Pending | None = None
        self._attached: MixedPrecision | None = None

    # ------------------------------------------------------------------ API
    # history, log_every_n_steps, step, state_dict, load_state_dict, repr: MonitorFacade
    @staticmethod
    def _plugin(trainer: pl.Trainer) -> MixedPrecision:
        plugin = trainer.precision_plugin
        if not isinstance(plugin, MixedPrecision):
            raise MisconfigurationException(
                f"MixedPrecisionMonitor reads the loss scaler of lightning_ext.MixedPrecision, but the trainer "
                f"uses {type(plugin).__name__}. Pass Trainer(plugins=[lightning_ext.MixedPrecision('16-mixed')]) "
                "(or another recipe) together with the monitor."
            )
        return plugin

    def _storage_dtypes(self, trainer: pl.Trainer) -> dict[int, tuple[str, str]]:
        """``id(optimizer param) -> (stored dtype, swamping dtype)``: :func:`lightning_ext.memory.storage_dtypes`."""
        return storage_dtypes(self._plugin(trainer), trainer.lightning_module, trainer.optimizers)

    def memory_report(self, trainer: pl.Trainer) -> dict[str, Any]:
        """Model state actually held, next to the core's estimate: :func:`lightning_ext.memory.memory_report`."""
        return memory_report(self._plugin(trainer), trainer.lightning_module, trainer.optimizers)

    # ------------------------------------------------------------- lifecycle
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Check that the trainer uses :class:`lightning_ext.MixedPrecision` (clear error otherwise)."""
        if stage == "fit":
            plugin = self._plugin(trainer)
            plugin.loss_scaler.attach_monitor(self)  # with scaling off, steps now check for (and count) overflows
            self._attached = plugin

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Read the step counter (one sync), re-apply restored fallbacks, install hooks, log memory."""
        plugin = self._plugin(trainer)
        self._step = plugin.loss_scaler.steps
        self._pending = None
        if self.core.fallback is not None:
            for path in self.core.fallback.moved:
                self._move_to_fp32(plugin, pl_module, path)
        if self.attribute_overflows:
            self.tracer.install(pl_module)
        if self.log_memory:
            self._log_memory(trainer, "train_start")
        if self.report_policy:
            rank_zero_info(self.core.record_policy(policy_report(pl_module, plugin.policy), self._step))

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Finish the last step, log memory, remove the hooks."""
        self._finalize(trainer)
        if self.log_memory:
            self._log_memory(trainer, "train_end")
        self.tracer.remove()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        """Training failed: remove the hooks, stop recording, forget the unfinished step."""
        self.uninstall()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Remove the hooks."""
        self.uninstall()

    def uninstall(self) -> None:
        """Remove the attribution hooks, forget any unfinished step, detach from the plugin (idempotent)."""
        self.tracer.active = False
        self.tracer.remove()
        self._pending = None
        plugin, self._attached = getattr(self, "_attached", None), None
        if plugin is not None:
            plugin.loss_scaler.detach_monitor(self)

    # ------------------------------------------------------------ per step
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        """Start recording attribution flags for this batch's forward/backward."""
        self.tracer.active = self.attribute_overflows
        fp8 = self._plugin(trainer).fp8
        if fp8 is not None:  # fp8-mixed: count saturated / flushed elements on logging steps only
            fp8.measure = self.core.should_log(self._step + 1)

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Tensor) -> None:
        """Record whether the loss itself is non-finite (a device flag)."""
        self.tracer.on_loss(loss)

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                                 optimizer: Any) -> None:
        """Grads are unscaled FP32 here: queue the meters and snapshot parameters on logging steps."""
        self._finalize(trainer)  # an earlier optimizer step of the same batch (manual optimization)
        plugin = self._plugin(trainer)
        logging = self.core.should_log(self._step + 1)
        pending = _Pending(optimizer=optimizer, state=plugin.loss_scaler.state, cut=len(self.tracer.records),
                           logging=logging)
        if logging:
            params = optimizer_params(optimizer)
            if self.measure_grads:
                grads = [p.grad for p in params if p.grad is not None]
                if grads:
                    pending.grad_norm = grad_norm(grads)
                    pending.underflow = underflow_counts(grads, plugin.policy.compute, plugin.loss_scaler.grad_scale,
                                                         self.meter_samples)
            if self.measure_swamping:
                with torch.no_grad():  # only the sampled elements are kept and compared
                    pending.before = [(p, sample(p, self.meter_samples).clone()) for p in params if p.requires_grad]
                if plugin.rounding is not None:  # bf16-kahan/-sr: the optimizer's FP32 update, before rounding
                    plugin.rounding.request_update_samples(self.meter_samples)
        self._pending = pending

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        """Finish the step the plugin just decided (no-op between accumulation boundaries)."""
        self.tracer.active = False
        loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
        self._finalize(trainer, loss if isinstance(loss, Tensor) else None)

    # ------------------------------------------------------------- the step
    def _finalize(self, trainer: pl.Trainer, loss: Tensor | None = None) -> None:
        pending, self._pending = self._pending, None
        if pending is None:
            return
        plugin = self._plugin(trainer)
        if plugin.loss_scaler.state is pending.state:  # training_step returned None: no transition
            self.tracer.take(pending.cut)
            return
        self._step += 1
        step = self._step
        overflow_host = plugin.last_step_skipped(pending.optimizer) if plugin.can_skip else False
        if not self.core.should_record(step, overflow_host):
            self.tracer.take(pending.cut)
            self.core.observe_clean()
            return
        latest = plugin.latest_stats()
        layout, values = PackedLayout(), []

        def add(name: str, value: Tensor | None) -> None:
            if value is not None:
                layout.add(name)
                values.append(value)

        for key in ("scale", "overflow", "overflows_total", "skipped_total", "growths_total"):
            add(key, latest[key])
        add("grad_norm", pending.grad_norm)
        if pending.underflow is not None:
            add("underflow_lost", pending.underflow[0])
            add("underflow_total", pending.underflow[1])
        if pending.before and not overflow_host:  # swamping: measured on applied steps only
            with torch.no_grad():
                storage = self._storage_dtypes(trainer)
                rounded = plugin.rounding.update_samples if plugin.rounding is not None else {}
                updates = [rounded[id(p)] if id(p) in rounded else sample(p, self.meter_samples) - b
                           for p, b in pending.before]
                lost, total = swamped_counts([b for _, b in pending.before], updates,
                                             [storage.get(id(p), ("float32", "float32"))[1] for p, _ in pending.before])
            add("swamp_lost", lost)
            add("swamp_total", total)
        if loss is not None and loss.numel() == 1:
            add("loss", loss.detach())
        if plugin.sharded is not None:  # FSDP2: meters of the local shards, made global (one all-reduce)
            values = plugin.sharded.reduce_meters(layout.names, values)
        device = values[0].device
        got = layout.unpack(torch.stack([v.detach().reshape(()).to(device=device, dtype=torch.float64)
                                         for v in values]).tolist())
        overflow = bool(got["overflow"])

        def counts(prefix: str) -> tuple[float, float] | None:
            return (got[f"{prefix}_lost"], got[f"{prefix}_total"]) if f"{prefix}_total" in got else None

        records = self.tracer.take(pending.cut)
        module = blame(records) if (overflow and self.attribute_overflows) else None
        stats = StepStats.from_counts(
            step, got["scale"], overflow, got["overflows_total"], got["skipped_total"], got["growths_total"],
            loss=got.get("loss"), grad_norm=got.get("grad_norm"), underflow=counts("underflow"),
            swamped=counts("swamp"), overflow_module=module,
            fp8=plugin.fp8.host_metrics() if plugin.fp8 is not None else None)  # fp8-mixed: one more read
        try:
            moved = self.core.record(stats, plugin.recipe.scaler.min_scale)
        finally:
            self._log(trainer, stats)
        for path in moved:
            self._move_to_fp32(plugin, trainer.lightning_module, path)
            message = self.core.fallback_message(path)
            rank_zero_info(message)
            self._log_text(trainer, "mp/fallback", message, step)

    def _move_to_fp32(self, plugin: MixedPrecision, pl_module: pl.LightningModule, path: str) -> None:
        try:
            module = pl_module.get_submodule(path)
        except AttributeError:
            rank_zero_info(f"MixedPrecisionMonitor: no module {path!r} to keep in FP32 in this model; skipped.")
            return
        plugin.keep_in_fp32(path, module)

    # ------------------------------------------------------------- logging
    @staticmethod
    def _log_text(trainer: pl.Trainer, tag: str, text: str, step: int) -> None:
        for lg in trainer.loggers:
            experiment = getattr(lg, "experiment", None)
            add_text = getattr(experiment, "add_text", None)
            if callable(add_text):
                add_text(tag, text, global_step=step)

    def _log(self, trainer: pl.Trainer, stats: StepStats) -> None:
        metrics = stats.metrics()
        text = metrics.pop(OVERFLOW_MODULE, None)
        numbers = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))}
        for lg in trainer.loggers:
            lg.log_metrics(numbers, step=stats.step)
        if text is not None:
            self._log_text(trainer, OVERFLOW_MODULE, str(text), stats.step)

    def _log_memory(self, trainer: pl.Trainer, when: str) -> None:
        report = self.memory_report(trainer)
        report["when"] = when
        self.memory_reports.append(report)
        self.history.add_event("memory", step=self._step, **report)
        for lg in trainer.loggers:
            lg.log_metrics(memory_metrics(report), step=self._step)
