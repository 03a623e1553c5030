"""``keras_ext.MixedPrecisionMonitor``: the core's diagnostics as a Keras callback.

The Keras twin of ``lightning_ext.MixedPrecisionMonitor``:
:class:`~mp_callbacks.diagnostics.monitor.MonitorCore` decides the cadence, keeps the
:class:`~mp_callbacks.diagnostics.metrics.History`, runs the divergence guard and the
auto-fallback tracker; this callback gathers the numbers from
:class:`keras_ext.LossScaleOptimizer` (and its ``recipe``) and writes the
shared metric names into Keras ``logs``: on logging steps into the batch
``logs`` (TensorBoard with ``update_freq``, later batch callbacks), at every
epoch end into the epoch ``logs`` (``History``, ``CSVLogger``): the scaler
values of the epoch's last step and each meter's last logged value (a meter
never logged is left out, never a NaN placeholder).  ``mp/overflow_module`` is
text: history, events and state only.  Steps are numbered as in Lightning
(one per scaler transition, 1-based, continuing across resumes); ``mp/scale``
is the scale the step's gradients were produced with, the counters are the
totals after the step.

Host syncs: none between logging steps.  The monitor attaches to the
optimizer (:class:`~mp_callbacks.diagnostics.monitor.MonitorPort`), which calls
:meth:`MixedPrecisionMonitor.on_optimizer_step` inside the traced step; it only
writes the :class:`~keras_ext.diagnostics.DeviceRecord` (the step's scale and
flag, the meters when a device flag asks for them, one row per overflow step).
Logging steps and epoch / train end read it in one host read; the swamping
meter (:class:`~keras_ext.diagnostics.meters.SwampMeter`) snapshots the sampled
elements of the updated variables (FP32 masters under ``*-master``) before a
logging step.  Overflow steps between two reads are recorded (exact step,
scale, counters, culprit) at the next read, where the guard and the fallback
act; beyond ``overflow_buffer`` rows the oldest are dropped (a ``"dropped"``
event; counters stay exact).  Attribution: :mod:`keras_ext.diagnostics.attribution`.
Under a multi-replica ``tf.distribute`` strategy the optimizer does not call
the monitor: meters, attribution and overflow rows are off, and a record takes
the optimizer's variables at the read (``mp/scale`` after the step,
``mp/overflow``: an overflow since the previous record).  JAX: the record
rides in the optimizer's step state (:class:`keras_ext.loss_scale.StepState`), the
trainer's state is synced into the variables on logging steps only, and
attribution (so the auto-fallback) is TensorFlow/torch only.

Persistence: :meth:`state_dict` is the core's plain-data envelope;
:meth:`save_state` / :meth:`load_state` (and ``state_path=``: loaded at train
start, written at every epoch end and train end) keep it as JSON.
"""

from __future__ import annotations

import json
import logging
import os
import warnings
from typing import Any

import keras

from mp_callbacks.diagnostics import (  # version: re-exported
    METER_SAMPLES,
    MONITOR_SCHEMA_VERSION,
    OVERFLOW_MODULE,
    DivergenceError,
    MonitorFacade,
    StepStats,
    json_safe,
    memory_metrics,
)
from mp_callbacks.dtypes import canonical_dtype

from ..fp8 import host_metrics as fp8_host_metrics
from ..ops import is_jax, is_tf, sync
from ..optimizer import LossScaleOptimizer
from ..policy import policy_report
from .attribution import LayerAttribution
from .fallback import blocked_message, move_layer_to_fp32
from .memory import memory_report
from .meters import SwampMeter
from .record import COUNTERS, DeviceRecord
from .swamping import swamp_counts, swamp_targets

__all__ = ["MONITOR_SCHEMA", "MONITOR_SCHEMA_VERSION", "MixedPrecisionMonitor"]

logger = logging.getLogger(__name__)

MONITOR_SCHEMA = "keras_ext.MixedPrecisionMonitor"
"""The ``schema`` tag of the monitor's state record."""

class MixedPrecisionMonitor(MonitorFacade, keras.callbacks.Callback):
    """Mixed-precision diagnostics for :class:`keras_ext.LossScaleOptimizer`, with the shared metric names.

    Args:
      log_every_n_steps: write a full record (all shared metrics) every N
        steps; overflow steps are always recorded (at the next read).
      divergence_patience: raise :class:`~mp_callbacks.diagnostics.DivergenceError`
        after this many consecutive overflows with the scale at its floor
        (None: never); the message names the scale, the step, the first
        non-finite layer and a checklist.
      auto_fallback_after: after this many overflows blamed on the same layer,
        give it (and its sub-layers) the ``float32`` dtype policy (None: never).
        Keras cannot change the dtype of built variables, so this needs the
        layer's variables in float32 (``*-mixed`` recipes); under ``*-master``
        it warns that the layer must be rebuilt with
        ``apply_policy(model, policy.with_fp32_modules(path))``.
      attribute_overflows: name the first non-finite layer of overflow steps
        (:class:`~keras_ext.diagnostics.attribution.LayerAttribution`: one in-graph
        reduction per layer output and input gradient every step).
        Default None: on exactly when ``auto_fallback_after`` is set.
      measure_grads: ``mp/grad_norm`` and ``mp/grad_underflow_frac`` on logging steps.
      measure_swamping: ``mp/update_swamped_frac`` on logging steps.
      meter_samples: elements per tensor that the underflow and swamping
        meters read (:func:`mp_callbacks.diagnostics.meters.sample_stride`); ``None`` reads
        every element.  ``mp/grad_norm`` always reads every element.
      log_memory: compute :meth:`memory_report` at train start and end.
      compute_dtype: the low-precision compute dtype of the underflow rule
        (default: the compute dtype of the optimizer's recipe).
      state_path: a JSON file holding :meth:`state_dict` (loaded at train start
        when present, written at each epoch end and at train end).
      overflow_buffer: device rows for overflow steps between two reads.
      history_maxlen: records kept in :attr:`history`.
      report_policy: at train start, print what the policy decided per layer
        (:func:`keras_ext.policy_report`; kept as a ``"policy"`` history event).

    While attached, the optimizer's per-step overflow check runs even where no
    step is skipped (``skip_nonfinite=False``; :func:`mp_callbacks.loss_scale.checks_overflow`).
    Put the monitor *before* ``TensorBoard``/``CSVLogger`` in ``callbacks`` so
    that they see the names it adds to ``logs``.  With ``steps_per_execution=k``
    a logging record is the last step of an execution that contains a logging
    step (overflow rows stay per step).

    Example::

        monitor = keras_ext.MixedPrecisionMonitor(log_every_n_steps=50, auto_fallback_after=3)
        model.fit(x, y, callbacks=[monitor, keras.callbacks.CSVLogger("log.csv")])
        monitor.history.to_jsonl("mp.jsonl")
    """

    SCHEMA = MONITOR_SCHEMA
    STATE_WORD = "state"

    def __init__(self, log_every_n_steps: int = 50, divergence_patience: int | None = None,
                 auto_fallback_after: int | None = None, attribute_overflows: bool | None = None,
                 measure_grads: bool = True, measure_swamping: bool = True, log_memory: bool = True,
                 compute_dtype: str | None = None, state_path: str | os.PathLike[str] | None = None,
                 overflow_buffer: int = 256, history_maxlen: int = 100_000,
                 meter_samples: int | None = METER_SAMPLES, report_policy: bool = False) -> None:
        super().__init__()
        self._setup(log_every_n_steps, divergence_patience, auto_fallback_after, attribute_overflows,
                    measure_grads, measure_swamping, log_memory, history_maxlen, meter_samples, report_policy)
        if not isinstance(overflow_buffer, int) or overflow_buffer < 1:
            raise ValueError(f"overflow_buffer={overflow_buffer!r} must be an integer >= 1")
        self.compute_dtype = canonical_dtype(compute_dtype) if compute_dtype else None
        self.state_path = os.fspath(state_path) if state_path is not None else None
        self.overflow_buffer = overflow_buffer
        self.attribution = LayerAttribution()
        self._last_seen = 0
        self._dev: DeviceRecord | None = None
        self._opt: LossScaleOptimizer | None = None
        self._compute = "float32"
        self._logging_now = False
        self._begin_step = 0
        self._swamp = SwampMeter(self.meter_samples)
        self.fallback_messages: list[str] = []  # the layers moved to FP32 by the auto-fallback in this process
        self._last_logged: dict[str, float] = {}
        self._hooked = True
        self._overflows_seen = 0

    # history, log_every_n_steps, step, state_dict, load_state_dict, repr: MonitorFacade
    def _optimizer(self) -> LossScaleOptimizer:
        opt = getattr(self.model, "optimizer", None)
        if not isinstance(opt, LossScaleOptimizer):
            raise TypeError("keras_ext.MixedPrecisionMonitor reads the loss scaler of keras_ext.LossScaleOptimizer, "
                            f"but the model is compiled with {type(opt).__name__}. Compile with keras_ext."
                            "LossScaleOptimizer(keras.optimizers.Adam(), 'keras') or keras_ext.master_optimizer(...).")
        return opt

    # ------------------------------------------------------------- lifecycle
    def on_train_begin(self, logs: dict | None = None) -> None:
        """Remove what a failed run left, load state, read the step counter, attach (retrace), log memory."""
        self.uninstall()
        opt = self._opt = self._optimizer()
        if not opt.built:
            opt.build(self.model.trainable_variables)
        if self.state_path and os.path.exists(self.state_path):
            self.load_state(self.state_path)
        strategy = getattr(self.model, "distribute_strategy", None)
        self._hooked = not (strategy is not None and getattr(strategy, "num_replicas_in_sync", 1) > 1)
        self._overflows_seen = opt.overflows
        if not self._hooked:
            warnings.warn("keras_ext.MixedPrecisionMonitor: meters and overflow attribution need a single replica; "
                          "with several replicas only the scaler values are recorded", stacklevel=2)
        self._dev = DeviceRecord(self.overflow_buffer, strategy if is_tf() else None)
        self._compute = self.compute_dtype or opt.recipe.policy.compute
        self._step = self._last_seen = opt.steps
        if self.core.fallback is not None:
            for path in self.core.fallback.moved:
                self._move_to_fp32(path, announce=False)
        if self.attribute_overflows and is_jax():  # (its probes would have to leave the JAX trainer's grad)
            warnings.warn("keras_ext.MixedPrecisionMonitor: overflow attribution (so the auto-fallback) is "
                          "TensorFlow/torch only: off on JAX", stacklevel=2)
            self.attribute_overflows = False
        if self.attribute_overflows:
            self.attribution.install(self.model)
        opt.attach_monitor(self)
        rounding = opt.update_rounding
        if rounding is not None:  # bf16-kahan/bf16-sr: the FP32 updates, kept by the rounding
            rounding.track_updates(self.measure_swamping, self.meter_samples)
        tracked = [v for b, u, _ in (rounding.tracked_updates() if rounding is not None else []) for v in (b, u)]
        opt.step_state.register("monitor", self._dev.variables + tracked)  # JAX: threaded through the step
        self._retrace()
        if self.log_memory:
            self._log_memory("train_start", logs)
        if self.report_policy:
            print(self.core.record_policy(policy_report(self.model), self._step))

    def on_train_end(self, logs: dict | None = None) -> None:
        """Record what is left, log memory, detach and uninstall, save the state file."""
        try:
            self._drain()
            if self.log_memory:
                self._log_memory("train_end", logs)
        finally:
            self.uninstall()
        if self.state_path:
            self.save_state(self.state_path)

    def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        """On a logging step: ask for the gradient meters, snapshot the weights to update."""
        self._begin_step = batch
        spe = getattr(self._model, "steps_per_execution", 1)  # not self.model: on JAX its getter syncs the state
        n = spe if isinstance(spe, int) and spe > 0 else 1
        self._logging_now = any(self.core.should_log(k) for k in range(self._step + 1, self._step + n + 1))
        if not self._logging_now:
            return
        sync(self.model)  # JAX: the step after this one reads the request and the weights from the variables
        if self.measure_grads:
            self._dev.ask(True)
        if self.measure_swamping:
            self._swamp.snapshot(swamp_targets(self.model, self._opt))

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        """Count the steps; on a logging step read the device values once and write ``logs``."""
        self._step += max(1, int(batch) - int(self._begin_step) + 1)
        if not self._logging_now:
            return
        self._logging_now = False
        stats = self._drain(logging=True)
        if stats is not None and logs is not None:
            logs.update({k: v for k, v in stats.metrics().items() if k != OVERFLOW_MODULE})

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        """Record pending overflow rows; the epoch ``logs`` get the last step's scaler values and
        each meter's last logged value."""
        snapshot = self._drain()
        if logs is not None and snapshot is not None:
            logs.update(self._last_logged)
            logs.update({k: v for k, v in snapshot.metrics().items() if k != OVERFLOW_MODULE})
            if self.memory_reports:
                logs.update(memory_metrics(self.memory_reports[-1]))
        if self.state_path:
            self.save_state(self.state_path)

    # ---------------------------------------------------------- installing
    def uninstall(self) -> None:
        """Detach from the optimizer and remove the attribution wrappers (idempotent).  Runs at train end,
        before a :class:`~mp_callbacks.diagnostics.DivergenceError` (the guard's or the optimizer's) propagates
        and at the next train start; after a ``fit`` that raised otherwise, call it to restore the model."""
        self._logging_now = False
        self.attribution.uninstall()
        if self._opt is not None and self._opt.monitor is self:
            sync(self.model)  # JAX: the trainer's state into the variables while they are still listed
            self._opt.detach_monitor(self)
            self._opt.step_state.remove("monitor")
            if self._opt.update_rounding is not None:
                self._opt.update_rounding.track_updates(False)
            self._retrace()
        self._swamp.clear()

    def _retrace(self) -> None:
        """A new train function (the step traced again with or without the monitor), watched by the optimizer's
        divergence rule (:meth:`keras_ext.loss_scale.divergence.KerasDivergence.watch`)."""
        if hasattr(self.model, "make_train_function"):
            self.model.make_train_function(force=True)
            if self._opt is not None:
                self._opt._divergence.watch(self.model, before_first_call=True)

    # -------------------------------------------------------- the device hook
    def on_optimizer_step(self, found_inf: Any, grads: list[Any], tvs: list[Any], scale_used: Any) -> None:
        """Called by the optimizer inside the (traced) step, after its scaler transition: device writes only."""
        dev, opt = self._dev, self._opt
        if dev is None or opt is None:
            return
        attribution = self.attribution if self.attribute_overflows else None
        dev.write_step(found_inf, grads, tvs, scale_used, opt.loss_scaler, self.measure_grads, self._compute,
                       self.meter_samples, attribution)

    # -------------------------------------------------------------- reading
    def _drain(self, logging: bool = False) -> StepStats | None:
        """One read: record the overflow rows since the last read, then (``logging``) this step's record.

        Returns the record of the current step (None before the first step).
        """
        dev, opt = self._dev, self._opt
        if dev is None or opt is None:
            return None
        sync(self.model)  # JAX: the trainer's state into the variables read here
        swamp = swamp_counts(self._swamp, opt, self.measure_swamping) if logging else None
        self._swamp.clear()
        if logging and self.measure_grads:
            dev.ask(False)
        got = dev.read([opt.loss_scaler.variable(c) for c in COUNTERS], opt.loss_scaler.variable("scale"), swamp)
        if got["dropped"]:
            self.history.add_event("dropped", step=self._step, rows=got["dropped"])
        current_module: str | None = None
        for row in got["rows"]:  # one per overflow step
            step = int(row["step"])
            if not self.core.should_record(step, overflow=True):
                continue
            module = self.attribution.name(int(row["culprit"]), int(row["generation"])) \
                if self.attribute_overflows else None
            if logging and step == self._step:
                current_module = module
                continue
            self._observe(StepStats.from_counts(step, row["scale"], True, row["overflows"], row["skipped"],
                                                row["growths"], overflow_module=module))
        if self._step == 0:
            return None
        stats, counters = got["stats"], got["counters"]
        if not self._hooked:  # multi-replica: no device hook, read the optimizer's variables
            stats.update(scale=got["scale"], found=float(counters[0] > self._overflows_seen))
        self._overflows_seen = int(counters[0])
        overflow = bool(stats["found"])
        measured = logging and stats["measured"] == 1.0
        swamped = got.get("extra")  # measured on applied steps only
        current = StepStats.from_counts(
            self._step, stats["scale"], overflow, *counters,
            grad_norm=stats["grad_norm"] if measured else None,
            underflow=(stats["underflow_lost"], stats["underflow_total"]) if measured else None,
            swamped=(swamped[0], swamped[1]) if swamped is not None and not overflow else None,
            overflow_module=(current_module if overflow and self.attribute_overflows else None),
            fp8=fp8_host_metrics(self.model) if logging else None,  # fp8-mixed: the last applied step's
        )
        if logging:
            self._observe(current)
        elif self._step > self._last_seen:
            self.core.observe_clean()
            self._last_seen = self._step
        if self.history and self.history[-1].step == self._step:
            return self.history[-1]
        return current

    def _observe(self, stats: StepStats) -> None:
        """Guard bookkeeping for the steps skipped over, then record ``stats`` (maybe moving a layer)."""
        if stats.step > self._last_seen + 1:
            self.core.observe_clean()  # a clean, unrecorded step came in between
        self._last_seen = max(self._last_seen, stats.step)
        self._last_logged.update({k: v for k, v in stats.metrics().items() if k != OVERFLOW_MODULE})
        try:
            moved = self.core.record(stats, float(self._opt.scaler_config.min_scale))
        except DivergenceError:
            self.uninstall()
            raise
        for path in moved:
            self._move_to_fp32(path, announce=True, step=stats.step)

    # ------------------------------------------------------------ fallback
    def _move_to_fp32(self, path: str, announce: bool = True, step: int | None = None) -> bool:
        """Give layer ``path`` and its sub-layers the float32 policy (:func:`.fallback.move_layer_to_fp32`)."""
        low = move_layer_to_fp32(self.model, path)
        if low is None:
            logger.info("MixedPrecisionMonitor: no layer %r to keep in FP32 in this model; skipped.", path)
            return False
        if low:
            warnings.warn(blocked_message(path, low), stacklevel=2)
            self.history.add_event("fallback_failed", step=step if step is not None else self._step, module=path)
            return False
        self._retrace()
        if announce:
            message = self.core.fallback_message(path)
            logger.warning(message)
            self.fallback_messages.append(message)
        return True

    # --------------------------------------------------------------- memory
    def memory_report(self) -> dict[str, Any]:
        """What the model and optimizer hold next to the core's estimate (:func:`.memory.memory_report`)."""
        return memory_report(self.model, self._opt or self._optimizer())

    def _log_memory(self, when: str, logs: dict | None) -> None:
        report = self.memory_report()
        report["when"] = when
        self.memory_reports.append(report)
        self.history.add_event("memory", step=self._step, **report)
        if logs is not None:
            logs.update(memory_metrics(report))

    # ---------------------------------------------------------- persistence
    def save_state(self, path: str | os.PathLike[str]) -> None:
        """Write :meth:`state_dict` as JSON (non-finite numbers as strings, as the history's JSONL does)."""
        tmp = f"{os.fspath(path)}.tmp"
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump(json_safe(self.state_dict()), fh)
        os.replace(tmp, path)

    def load_state(self, path: str | os.PathLike[str]) -> None:
        """Read a file written by :meth:`save_state`."""
        with open(path, encoding="utf-8") as fh:
            self.load_state_dict(json.load(fh))

