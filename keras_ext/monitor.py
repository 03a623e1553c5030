"""``keras_ext.MixedPrecisionMonitor``: the core's diagnostics as a Keras callback.

The Keras twin of :class:`lightning_ext.MixedPrecisionMonitor`:
:class:`~mp_callbacks.monitor.MonitorCore` decides the cadence, keeps the
:class:`~mp_callbacks.diagnostics.History`, runs the divergence guard and the
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
optimizer (:class:`~mp_callbacks.monitor.MonitorPort`), which calls
:meth:`MixedPrecisionMonitor.on_optimizer_step` inside the traced step; it only
writes the :class:`~keras_ext.device_record.DeviceRecord` (the step's scale and
flag, the meters when a device flag asks for them, one row per overflow step).
Logging steps and epoch / train end read it in one host read; the swamping
meter (:class:`~keras_ext.keras_meters.SwampMeter`) snapshots the sampled
elements of the updated variables (FP32 masters under ``*-master``) before a
logging step.  Overflow steps between two reads are recorded (exact step,
scale, counters, culprit) at the next read, where the guard and the fallback
act; beyond ``overflow_buffer`` rows the oldest are dropped (a ``"dropped"``
event; counters stay exact).  Attribution: :mod:`keras_ext.attribution`.
Under a multi-replica ``tf.distribute`` strategy the optimizer does not call
the monitor: meters, attribution and overflow rows are off, and a record takes
the optimizer's variables at the read (``mp/scale`` after the step,
``mp/overflow``: an overflow since the previous record).

Persistence: :meth:`state_dict` is the core's plain-data envelope;
:meth:`save_state` / :meth:`load_state` (and ``state_path=``: loaded at train
start, written at every epoch end and train end) keep it as JSON.
"""

from __future__ import annotations

import json
import logging
import os
import warnings
from typing import Any, Optional

import keras
from keras import ops

from mp_callbacks.diagnostics import OVERFLOW_MODULE, StepStats, json_safe, memory_metrics
from mp_callbacks.dtypes import canonical_dtype
from mp_callbacks.meters import METER_SAMPLES, DivergenceError
from mp_callbacks.monitor import MONITOR_SCHEMA_VERSION, MonitorFacade  # version: re-exported
from mp_callbacks.monitor_helpers import swamp_storage_dtype

from .attribution import LayerAttribution
from .device_record import COUNTERS, DeviceRecord
from .fp8 import host_metrics as fp8_host_metrics
from .fp8 import is_fp8_variable
from .keras_meters import SwampMeter, grad_norm, swamped_counts, underflow_counts
from .keras_ops import is_tf
from .memory import memory_report
from .optimizer import LossScaleOptimizer
from .policy import _own_variables, _walk, keep_layer_in_fp32, policy_report

__all__ = ["MONITOR_SCHEMA", "MONITOR_SCHEMA_VERSION", "MixedPrecisionMonitor"]

logger = logging.getLogger(__name__)

MONITOR_SCHEMA = "keras_ext.MixedPrecisionMonitor"
"""The ``schema`` tag of the monitor's state record."""

class MixedPrecisionMonitor(MonitorFacade, keras.callbacks.Callback):
    """Mixed-precision diagnostics for :class:`keras_ext.LossScaleOptimizer`, with the shared metric names.

    Args:
      log_every_n_steps: write a full record (all shared metrics) every N
        steps; overflow steps are always recorded (at the next read).
      divergence_patience: raise :class:`~mp_callbacks.meters.DivergenceError`
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
        (:class:`~keras_ext.attribution.LayerAttribution`: one in-graph
        reduction per layer output and input gradient every step).
        Default None: on exactly when ``auto_fallback_after`` is set.
      measure_grads: ``mp/grad_norm`` and ``mp/grad_underflow_frac`` on logging steps.
      measure_swamping: ``mp/update_swamped_frac`` on logging steps.
      meter_samples: elements per tensor that the underflow and swamping
        meters read (:func:`mp_callbacks.meters.sample_stride`); ``None`` reads
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
    step is skipped (``skip_nonfinite=False``; :func:`mp_callbacks.scaler.checks_overflow`).
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

    def __init__(self, log_every_n_steps: int = 50, divergence_patience: Optional[int] = None,
                 auto_fallback_after: Optional[int] = None, attribute_overflows: Optional[bool] = None,
                 measure_grads: bool = True, measure_swamping: bool = True, log_memory: bool = True,
                 compute_dtype: Optional[str] = None, state_path: Optional[str | os.PathLike[str]] = None,
                 overflow_buffer: int = 256, history_maxlen: int = 100_000,
                 meter_samples: Optional[int] = METER_SAMPLES, report_policy: bool = False) -> None:
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
        self._dev: Optional[DeviceRecord] = None
        self._opt: Optional[LossScaleOptimizer] = None
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
    def on_train_begin(self, logs: Optional[dict] = None) -> None:
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
        if self.attribute_overflows:
            self.attribution.install(self.model)
        opt.attach_monitor(self)
        if opt.update_rounding is not None:  # bf16-kahan/bf16-sr: the FP32 updates, kept by the rounding
            opt.update_rounding.track_updates(self.measure_swamping, self.meter_samples)
        self._retrace()
        if self.log_memory:
            self._log_memory("train_start", logs)
        if self.report_policy:
            print(self.core.record_policy(policy_report(self.model), self._step))

    def on_train_end(self, logs: Optional[dict] = None) -> None:
        """Record what is left, log memory, detach and uninstall, save the state file."""
        try:
            self._drain()
            if self.log_memory:
                self._log_memory("train_end", logs)
        finally:
            self.uninstall()
        if self.state_path:
            self.save_state(self.state_path)

    def on_train_batch_begin(self, batch: int, logs: Optional[dict] = None) -> None:
        """On a logging step: ask for the gradient meters, snapshot the weights to update."""
        self._begin_step = batch
        spe = getattr(self.model, "steps_per_execution", 1)
        n = spe if isinstance(spe, int) and spe > 0 else 1
        self._logging_now = any(self.core.should_log(k) for k in range(self._step + 1, self._step + n + 1))
        if not self._logging_now:
            return
        if self.measure_grads:
            self._dev.request.assign(1)
        if self.measure_swamping:
            self._swamp.snapshot(self._swamp_targets())

    def on_train_batch_end(self, batch: int, logs: Optional[dict] = None) -> None:
        """Count the steps; on a logging step read the device values once and write ``logs``."""
        self._step += max(1, int(batch) - int(self._begin_step) + 1)
        if not self._logging_now:
            return
        self._logging_now = False
        stats = self._drain(logging=True)
        if stats is not None and logs is not None:
            logs.update({k: v for k, v in stats.metrics().items() if k != OVERFLOW_MODULE})

    def on_epoch_end(self, epoch: int, logs: Optional[dict] = None) -> None:
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
        before a :class:`~mp_callbacks.meters.DivergenceError` (the guard's or the optimizer's) propagates
        and at the next train start; after a ``fit`` that raised otherwise, call it to restore the model."""
        self._logging_now = False
        self.attribution.uninstall()
        if self._opt is not None and self._opt.monitor is self:
            self._opt.detach_monitor(self)
            if self._opt.update_rounding is not None:
                self._opt.update_rounding.track_updates(False)
            self._retrace()
        self._swamp.clear()

    def _retrace(self) -> None:
        if hasattr(self.model, "make_train_function"):
            self.model.make_train_function(force=True)

    # -------------------------------------------------------- the device hook
    def on_optimizer_step(self, found_inf: Any, grads: list[Any], tvs: list[Any], scale_used: Any) -> None:
        """Called by the optimizer inside the (traced) step, after its scaler transition: device writes only."""
        dev, opt = self._dev, self._opt
        if dev is None or opt is None:
            return
        found = ops.convert_to_tensor(found_inf)
        dense = [g for g, v in zip(grads, tvs) if g is not None and not is_fp8_variable(v)]  # FP8 states: no grads
        nan = ops.convert_to_tensor(float("nan"), dtype="float64")

        def basic() -> None:
            dev.write_stats(scale=scale_used, found=found, grad_norm=nan, underflow_lost=nan, underflow_total=nan,
                            measured=0.0)

        def meters() -> None:
            lost, total = underflow_counts(dense, self._compute, ops.cast(scale_used, "float64"), self.meter_samples)
            dev.write_stats(scale=scale_used, found=found, grad_norm=grad_norm(dense), underflow_lost=lost,
                            underflow_total=total, measured=1.0)

        if self.measure_grads and dense:
            ops.cond(ops.greater(ops.convert_to_tensor(dev.request), 0), meters, basic)
        else:
            basic()
        trace = self.attribution.current() if self.attribute_overflows else None
        generation = self.attribution.generation

        def write() -> None:
            culprit = self.attribution.culprit(trace, grads, tvs) if trace is not None else -1.0
            counters = {c: ops.convert_to_tensor(opt.loss_scaler.variable(c)) for c in COUNTERS}
            dev.push_row(step=ops.convert_to_tensor(opt.loss_scaler.variable("steps")), scale=scale_used,
                         culprit=culprit, generation=float(generation), **counters)

        ops.cond(found, write, lambda: None)

    # -------------------------------------------------------------- reading
    def _swamp_targets(self) -> list[tuple[Any, str]]:
        """(the variable the optimizer updates, the dtype its update is measured against:
        :func:`~mp_callbacks.monitor_helpers.swamp_storage_dtype`; a variable counts as kept in FP32
        when its layer computes in float32, by policy or fallback)."""
        opt = self._opt
        kept: dict[int, bool] = {}
        for _, layer in _walk(self.model):
            fp32 = canonical_dtype(layer.dtype_policy.compute_dtype) == "float32"
            for v in _own_variables(layer):
                kept[id(v)] = fp32
        out = []
        rounding = opt.update_rounding
        for v in (v for v in self.model.trainable_variables if not is_fp8_variable(v)):
            if rounding is not None and rounding.working_variables[opt._get_variable_index(v)] is not None:
                continue  # bf16-kahan/bf16-sr: metered on the FP32 update the rounding keeps (_swamp_counts)
            stored = canonical_dtype(keras.backend.standardize_dtype(v.dtype))
            master = opt.master_variables[opt._get_variable_index(v)] if opt.master_weights else None
            target = master if master is not None else v  # the FP32 master under *-master
            out.append((target, swamp_storage_dtype(opt.recipe, stored, kept.get(id(v), stored == "float32"))))
        return out

    def _swamp_counts(self) -> Any:
        """``[lost, nonzero]`` of the step: the snapshot's targets, plus under ``bf16-kahan``/``bf16-sr`` the FP32
        updates the optimizer asked for (as Lightning meters them), kept by the update rounding."""
        counts = self._swamp.counts()
        rounding = self._opt.update_rounding
        tracked = rounding.tracked_updates() if rounding is not None and self.measure_swamping else []
        if tracked:
            extra = ops.stack(list(swamped_counts(*(list(x) for x in zip(*tracked)))))
            counts = extra if counts is None else ops.add(counts, extra)
        return counts

    def _drain(self, logging: bool = False) -> Optional[StepStats]:
        """One read: record the overflow rows since the last read, then (``logging``) this step's record.

        Returns the record of the current step (None before the first step).
        """
        dev, opt = self._dev, self._opt
        if dev is None or opt is None:
            return None
        swamp = self._swamp_counts() if logging else None
        self._swamp.clear()
        if logging and self.measure_grads:
            dev.request.assign(0)
        got = dev.read([opt.loss_scaler.variable(c) for c in COUNTERS], opt.loss_scaler.variable("scale"), swamp)
        if got["dropped"]:
            self.history.add_event("dropped", step=self._step, rows=got["dropped"])
        current_module: Optional[str] = None
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
    def _move_to_fp32(self, path: str, announce: bool = True, step: Optional[int] = None) -> bool:
        """Give layer ``path`` and its sub-layers the float32 policy (compute only: variables must be float32)."""
        layer = next((l for p, l in _walk(self.model) if p == path), None)
        if layer is None:
            logger.info("MixedPrecisionMonitor: no layer %r to keep in FP32 in this model; skipped.", path)
            return False
        layers = [layer] + [l for _, l in _walk(layer)]
        low = [v.path for l in layers for v in _own_variables(l)
               if keras.backend.standardize_dtype(v.dtype) in ("float16", "bfloat16")]
        if low:
            message = (f"MixedPrecisionMonitor: {path!r} keeps overflowing but its variables {low} are stored in low "
                       "precision, and Keras cannot change the dtype of built variables; rebuild the model with "
                       f"keras_ext.apply_policy(model, policy.with_fp32_modules({path!r})) before compile.")
            warnings.warn(message, stacklevel=2)
            self.history.add_event("fallback_failed", step=step if step is not None else self._step, module=path)
            return False
        for l in layers:
            l.dtype_policy = keras.DTypePolicy("float32")
        keep_layer_in_fp32(path)
        self._retrace()
        if announce:
            message = self.core.fallback_message(path)
            logger.warning(message)
            self.fallback_messages.append(message)
        return True

    # --------------------------------------------------------------- memory
    def memory_report(self) -> dict[str, Any]:
        """What the model and optimizer hold next to the core's estimate: :func:`keras_ext.memory.memory_report`."""
        return memory_report(self.model, self._opt or self._optimizer())

    def _log_memory(self, when: str, logs: Optional[dict]) -> None:
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

