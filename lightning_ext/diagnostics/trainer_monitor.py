"""``lightning_ext.MixedPrecisionMonitor``: the core's diagnostics as a Lightning Trainer callback.

The step logic is :class:`lightning_ext.diagnostics.monitor.FabricMonitor`'s (this callback subclasses it
and maps the Trainer's hooks onto it, as the Trainer plugin subclasses the Fabric one).  A thin
translation: :class:`~mp_callbacks.diagnostics.MonitorCore` decides the cadence, keeps the
:class:`~mp_callbacks.diagnostics.History`, records overflow attributions, runs the divergence
guard and the auto-fallback tracker; this callback gathers the numbers from torch and
:class:`lightning_ext.MixedPrecision`, and writes the shared metric names
(:data:`mp_callbacks.diagnostics.METRICS`) to every Lightning logger with
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
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from torch import Tensor

from ..fabric import MixedPrecision
from .memory import memory_report
from .monitor import FabricMonitor, Loop

__all__ = ["MixedPrecisionMonitor"]

MONITOR_SCHEMA = "lightning_ext.MixedPrecisionMonitor"
"""The ``schema`` tag of the callback's checkpoint record."""


class MixedPrecisionMonitor(FabricMonitor, Callback):
    """Mixed-precision diagnostics for :class:`lightning_ext.MixedPrecision`, with the shared metric names.

    Args:
      log_every_n_steps: log a full record (all shared metrics) every N steps;
        overflow steps are always recorded.  Between logging steps no host
        sync is added (see the module docstring).
      divergence_patience: raise :class:`~mp_callbacks.diagnostics.DivergenceError`
        after this many consecutive overflows with the scale at its floor
        (None: never).  The message names the scale, the step, the first
        non-finite module and a checklist.
      auto_fallback_after: after this many overflows blamed on the same module,
        move it to FP32 with :meth:`MixedPrecision.keep_in_fp32` (None: never).
      attribute_overflows: name the first non-finite module on overflow steps
        (forward hooks + gradient hooks queue one device reduction per module
        output and gradient every step).
        Default None: on exactly when ``auto_fallback_after`` is set.
      measure_grads: compute ``mp/grad_norm`` and ``mp/grad_underflow_frac`` on logging steps.
      measure_swamping: compute ``mp/update_swamped_frac`` on logging steps
        (snapshots the optimizer's parameters before the step).
      meter_samples: elements per tensor that the underflow and swamping
        meters read (a strided sample, :func:`mp_callbacks.diagnostics.sample_stride`),
        which bounds a logging step's cost per tensor; ``None`` reads every element.
        ``mp/grad_norm`` always reads every element.
      log_memory: log :meth:`memory_report` at train start and end.
      history_maxlen: records kept in :attr:`history`.
      report_policy: at train start, print (and keep as a ``"policy"`` history
        event) what the policy decided per module (:func:`~lightning_ext.policy.policy_report`).

    While attached, the monitor turns on the plugin's per-step overflow check
    for recipes without loss scaling (``mp/overflow``, ``mp/overflows_total``
    count inf/NaN gradients there too; see
    :func:`mp_callbacks.loss_scale.checks_overflow`): one pass over the gradients
    per step, the monitor's main per-step cost under bf16 recipes.

    ``mp/update_swamped_frac`` measures the applied update of every optimizer
    parameter (the FP32 master under ``*-master``; under ``bf16-kahan`` and
    ``bf16-sr`` the optimizer's FP32 update before the rounding rule writes
    it into the bf16 weight) against the dtype chosen by
    :func:`~mp_callbacks.diagnostics.swamp_storage_dtype`: the actual
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
    HOST = "Trainer"

    # ------------------------------------------------------------------ API
    # history, log_every_n_steps, step, state_dict, load_state_dict, repr: MonitorFacade
    def _plugin(self, trainer: pl.Trainer) -> MixedPrecision:
        return self._check_plugin(trainer.precision_plugin)

    def _loop(self, trainer: pl.Trainer) -> Loop:
        return Loop(self._plugin(trainer), trainer.lightning_module, trainer.optimizers, trainer.loggers)

    def memory_report(self, trainer: pl.Trainer) -> dict[str, Any]:  # type: ignore[override]
        """Model state actually held, next to the core's estimate: :func:`lightning_ext.diagnostics.memory_report`."""
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
        self._start(self._loop(trainer))

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Finish the last step, log memory, remove the hooks."""
        loop = self._loop(trainer)
        self._finalize(loop)
        if self.log_memory:
            self._log_memory(loop, "train_end")
        self.tracer.remove()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        """Training failed: remove the hooks, stop recording, forget the unfinished step."""
        self.uninstall()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Remove the hooks."""
        self.uninstall()

    # ------------------------------------------------------------ per step
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        """Start recording attribution flags for this batch's forward/backward."""
        self.tracer.active = self.attribute_overflows
        self._measure_fp8(self._plugin(trainer))

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Tensor) -> None:
        """Record whether the loss itself is non-finite (a device flag)."""
        self.tracer.on_loss(loss)

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                                 optimizer: Any) -> None:
        """Grads are unscaled FP32 here: queue the meters and snapshot parameters on logging steps."""
        self._finalize(self._loop(trainer))  # an earlier optimizer step of the same batch (manual optimization)
        self._queue(self._plugin(trainer), optimizer)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        """Finish the step the plugin just decided (no-op between accumulation boundaries)."""
        self.tracer.active = False
        loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
        self._finalize(self._loop(trainer), loss if isinstance(loss, Tensor) else None)
