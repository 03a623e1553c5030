"""``lightning_ext.FabricMonitor``: the core's diagnostics in a Fabric loop, and the step logic the Trainer's shares.

A thin translation, like the Trainer callback (:class:`lightning_ext.MixedPrecisionMonitor`, a
subclass of this one): :class:`~mp_callbacks.diagnostics.MonitorCore` decides the cadence, keeps
the :class:`~mp_callbacks.diagnostics.History`, records overflow attributions, runs the
divergence guard and the auto-fallback tracker; this class gathers the numbers from torch and the
plugin and writes the shared metric names (:data:`mp_callbacks.diagnostics.METRICS`) to every
logger with ``logger.log_metrics``.  The step numbering and host syncs are the Trainer callback's
(see :mod:`lightning_ext.diagnostics.trainer_monitor`).

In a Fabric loop it is a Fabric callback; nothing is called per step::

    monitor = FabricMonitor(log_every_n_steps=50)
    fabric = Fabric(plugins=[FabricMixedPrecision("16-mixed")], callbacks=[monitor], loggers=CSVLogger("logs"))
    model, optimizer = fabric.setup(model, optimizer)  # Fabric calls on_after_setup: the monitor attaches
    for x, y in loader:
        fabric.backward(loss_fn(model(x), y))  # the plugin hands the monitor the loss
        optimizer.step()                         # ... and the unscaled gradients; on_after_optimizer_step logs
        optimizer.zero_grad()
    monitor.detach()                             # the memory report at the end; hooks removed

With ``setup_module`` + ``setup_optimizers`` (Fabric then calls no ``on_after_setup``), call
``monitor.attach(fabric, model)`` once after them.  The logged loss is the one of the step's
(last) ``fabric.backward``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.fabric.utilities.rank_zero import rank_zero_info
from torch import Tensor, nn

from mp_callbacks.diagnostics import (
    METER_SAMPLES,
    OVERFLOW_MODULE,
    MonitorFacade,
    PackedLayout,
    StepStats,
    memory_metrics,
)

from ..fabric import MixedPrecision
from ..policy import policy_report
from .attribution import OverflowTracer, blame
from .memory import memory_report, optimizer_params, storage_dtypes
from .meters import grad_norm, sample, swamped_counts, underflow_counts

__all__ = ["FabricMonitor"]

FABRIC_MONITOR_SCHEMA = "lightning_ext.FabricMonitor"
"""The ``schema`` tag of the Fabric monitor's state record."""


class Loop(NamedTuple):
    """What the step logic needs from the training loop (a Trainer's or a Fabric's)."""

    plugin: MixedPrecision
    module: nn.Module
    optimizers: Sequence[Any]
    loggers: Sequence[Any]


@dataclass
class _Pending:
    """An optimizer step seen before the plugin's decision, finalized once it has decided."""

    optimizer: Any
    state: Any
    cut: int
    logging: bool
    grad_norm: Tensor | None = None
    underflow: tuple[Tensor, Tensor] | None = None
    before: list[tuple[Tensor, Tensor]] = field(default_factory=list)


class FabricMonitor(MonitorFacade):
    """Mixed-precision diagnostics for :class:`lightning_ext.fabric.MixedPrecision`, with the shared metric names.

    Takes the arguments of :class:`lightning_ext.MixedPrecisionMonitor` (``log_every_n_steps``,
    ``divergence_patience``, ``auto_fallback_after``, ``attribute_overflows``, ``measure_grads``,
    ``measure_swamping``, ``log_memory``, ``history_maxlen``, ``meter_samples``, ``report_policy``).
    """

    SCHEMA = FABRIC_MONITOR_SCHEMA
    STATE_WORD = "state"

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
        self._fabric: Any = None
        self._module: nn.Module | None = None
        self._loss: Tensor | None = None

    HOST = "Fabric"
    """What the error messages call the loop and its plugin's constructor."""

    def _check_plugin(self, plugin: Any) -> MixedPrecision:
        if not isinstance(plugin, MixedPrecision):
            name = "MixedPrecision" if self.HOST == "Trainer" else "FabricMixedPrecision"
            raise MisconfigurationException(
                f"{type(self).__name__} reads the loss scaler of lightning_ext.{name}, but the {self.HOST.lower()} "
                f"uses {type(plugin).__name__}. Pass {self.HOST}(plugins=[lightning_ext.{name}('16-mixed')]) "
                "(or another recipe) together with the monitor.")
        return plugin

    # ---------------------------------------------------------- Fabric hooks
    def attach(self, fabric: Any, module: nn.Module) -> None:
        """Start monitoring ``fabric``'s training of ``module`` (a ``_FabricModule`` or the model): the
        plugin hands this monitor each step; reads the step counter (one sync), installs hooks, logs memory."""
        plugin = self._check_plugin(fabric.strategy.precision)
        self._fabric = fabric
        self._module = module.module if hasattr(module, "_forward_module") else module  # a _FabricModule: the model
        plugin.loss_scaler.attach_monitor(self)
        self._attached = plugin
        self._start(self._fabric_loop())
        self.tracer.active = self.attribute_overflows
        self._measure_fp8(plugin)

    def on_after_setup(self, fabric: Any, module: Any) -> None:
        """Fabric's hook after ``fabric.setup(model, ...)``: :meth:`attach`."""
        self.attach(fabric, module)

    def on_after_optimizer_step(self, strategy: Any = None, optimizer: Any = None) -> None:
        """Fabric's hook after ``optimizer.step()``: finish the step the plugin just decided."""
        if self._attached is None:
            return
        self.tracer.active = False
        loss, self._loss = self._loss, None
        self._finalize(self._fabric_loop(), loss)
        self.tracer.active = self.attribute_overflows  # the next step's forward and backward
        self._measure_fp8(self._attached)

    def detach(self) -> None:
        """Finish the last step, log memory (``train_end``), remove the hooks, detach from the plugin."""
        if self._attached is not None:
            loop = self._fabric_loop()
            self._finalize(loop)
            if self.log_memory:
                self._log_memory(loop, "train_end")
        self.uninstall()

    def memory_report(self) -> dict[str, Any]:
        """Model state actually held, next to the core's estimate: :func:`lightning_ext.diagnostics.memory_report`."""
        loop = self._fabric_loop()
        return memory_report(loop.plugin, loop.module, loop.optimizers)

    def _fabric_loop(self) -> Loop:
        plugin = self._attached if self._attached is not None else self._check_plugin(self._fabric.strategy.precision)
        return Loop(plugin, self._module, list(plugin._optimizers), list(self._fabric.loggers))

    # ---------------------------------------------------------- from the plugin
    def on_loss(self, loss: Any) -> None:
        """From the plugin's ``backward``: keep the loss (logged with its step) and record whether it is
        non-finite (a device flag)."""
        if isinstance(loss, Tensor):
            self._loss = loss.detach()
            self.tracer.on_loss(loss)

    def before_optimizer_step(self, plugin: MixedPrecision, optimizer: Any) -> None:
        """From the plugin's step, grads unscaled FP32: queue the meters and snapshot parameters on logging steps."""
        self._finalize_if_pending()
        self._queue(plugin, optimizer)

    def _finalize_if_pending(self) -> None:
        if self._pending is not None and self._fabric is not None:
            self._finalize(self._fabric_loop())

    # ------------------------------------------------------------ the step
    def _start(self, loop: Loop) -> None:
        """Read the step counter (one sync), re-apply restored fallbacks, install hooks, log memory."""
        self._step = loop.plugin.loss_scaler.steps
        self._pending = None
        if self.core.fallback is not None:
            for path in self.core.fallback.moved:
                self._move_to_fp32(loop, path)
        if self.attribute_overflows:
            self.tracer.install(loop.module)
        if self.log_memory:
            self._log_memory(loop, "train_start")
        if self.report_policy:
            rank_zero_info(self.core.record_policy(policy_report(loop.module, loop.plugin.policy), self._step))

    def _measure_fp8(self, plugin: MixedPrecision) -> None:
        if plugin.fp8 is not None:  # fp8-mixed: count saturated / flushed elements on logging steps only
            plugin.fp8.measure = self.core.should_log(self._step + 1)

    def uninstall(self) -> None:
        """Remove the attribution hooks, forget any unfinished step, detach from the plugin (idempotent)."""
        self.tracer.active = False
        self.tracer.remove()
        self._pending = None
        plugin, self._attached = getattr(self, "_attached", None), None
        if plugin is not None:
            plugin.loss_scaler.detach_monitor(self)

    def _queue(self, plugin: MixedPrecision, optimizer: Any) -> None:
        """Grads are unscaled FP32 here: queue the meters and snapshot parameters on logging steps."""
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
                    read = plugin.masters.value_of if plugin.masters is not None else torch.Tensor.detach
                    pending.before = [(p, sample(read(p), self.meter_samples).clone()) for p in params
                                      if p.requires_grad]
                if plugin.rounding is not None:  # bf16-kahan/-sr: the optimizer's FP32 update, before rounding
                    plugin.rounding.request_update_samples(self.meter_samples)
        self._pending = pending

    def _finalize(self, loop: Loop, loss: Tensor | None = None) -> None:
        pending, self._pending = self._pending, None
        if pending is None:
            return
        plugin = loop.plugin
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
                storage = storage_dtypes(plugin, loop.module, loop.optimizers)
                rounded = plugin.rounding.update_samples if plugin.rounding is not None else {}
                read = plugin.masters.value_of if plugin.masters is not None else torch.Tensor.detach
                updates = [rounded[id(p)] if id(p) in rounded else sample(read(p), self.meter_samples) - b
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
            self._log(loop.loggers, stats)
        for path in moved:
            self._move_to_fp32(loop, path)
            message = self.core.fallback_message(path)
            rank_zero_info(message)
            self._log_text(loop.loggers, "mp/fallback", message, step)

    def _move_to_fp32(self, loop: Loop, path: str) -> None:
        try:
            module = loop.module.get_submodule(path)
        except AttributeError:
            rank_zero_info(f"{type(self).__name__}: no module {path!r} to keep in FP32 in this model; skipped.")
            return
        loop.plugin.keep_in_fp32(path, module)

    # ------------------------------------------------------------- logging
    @staticmethod
    def _log_text(loggers: Sequence[Any], tag: str, text: str, step: int) -> None:
        for lg in loggers:
            experiment = getattr(lg, "experiment", None)
            add_text = getattr(experiment, "add_text", None)
            if callable(add_text):
                add_text(tag, text, global_step=step)

    def _log(self, loggers: Sequence[Any], stats: StepStats) -> None:
        metrics = stats.metrics()
        text = metrics.pop(OVERFLOW_MODULE, None)
        numbers = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))}
        for lg in loggers:
            lg.log_metrics(numbers, step=stats.step)
        if text is not None:
            self._log_text(loggers, OVERFLOW_MODULE, str(text), stats.step)

    def _log_memory(self, loop: Loop, when: str) -> None:
        report = memory_report(loop.plugin, loop.module, loop.optimizers)
        report["when"] = when
        self.memory_reports.append(report)
        self.history.add_event("memory", step=self._step, **report)
        for lg in loop.loggers:
            lg.log_metrics(memory_metrics(report), step=self._step)
