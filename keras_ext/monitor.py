"""``keras_ext.MixedPrecisionMonitor``: the core's diagnostics as a Keras callback.

The Keras twin of :class:`lightning_ext.MixedPrecisionMonitor`.
:class:`~mp_callbacks.monitor.MonitorCore` decides the cadence, keeps the
:class:`~mp_callbacks.diagnostics.History`, records overflow attributions and
runs the divergence guard and the auto-fallback tracker; this callback
gathers the numbers from :class:`keras_ext.LossScaleOptimizer` and writes the
shared metric names into Keras ``logs``:

* on logging steps into the batch ``logs`` (so ``keras.callbacks.TensorBoard``
  with ``update_freq="batch"``/N and any batch-level callback listed *after*
  the monitor see them);
* at every epoch end into the epoch ``logs`` (so ``model.fit(...).history``,
  ``CSVLogger`` and TensorBoard's epoch scalars get them): the values of the
  epoch's last step (meters NaN when that step was not a logging step).

``mp/overflow_module`` is text: it goes to the history, its events and the
monitor state, never into ``logs``.

Step numbering and values are the Lightning monitor's: one step per scaler
transition, 1-based, continuing across resumes (the optimizer's ``steps``
counter, read once at train start); ``mp/scale`` is the scale the step's
gradients were produced with; the counters are the totals after the step.

Host syncs (TensorFlow backend, where the train step is a ``tf.function``):

* per step, between logging steps: **none**.  The optimizer calls the
  monitor's hook (:meth:`keras_ext.LossScaleOptimizer.set_stats_hook`) inside
  the traced step; it only writes device variables: the step's scale and
  overflow flag, and, on an overflow step, one row
  ``(step, scale, overflows, skipped, growths, culprit)`` into a device ring
  buffer (``overflow_buffer`` rows, default 256).  With attribution on, every
  layer also queues one float32 sum of its output and one of its input
  gradient (the probes; their finite test runs on overflow steps only) --
  the per-step device work the Lightning monitor's hooks do too.
* logging steps (every ``log_every_n_steps``) and epoch / train end: one read
  of one stacked vector (step values, meters, counters, ring buffer).  The
  monitor asks for the gradient meters by setting a device flag before the
  step (a host-to-device write, no sync); the swamping meter snapshots the
  updated variables (FP32 masters under ``*-master``) before the step and
  diffs them after with one compiled function (an extra parameter copy on
  logging steps only).
* train start / end: the optimizer's step counter, the memory report
  (variable sizes: metadata) and a retrace of the train function (the hooks
  are installed by tracing a new one and removed the same way).

Consequences of reading only on logging steps: overflow steps between two
logging steps are recorded (exact step, scale, counters and culprit, from the
ring buffer) at the next logging step or epoch end, and appear in
:attr:`history` and its events but not in that past batch's ``logs``; the
divergence guard and the auto-fallback act at that read (with
``log_every_n_steps=1`` they act after the very step, as in Lightning).  If
more than ``overflow_buffer`` overflows happen between two reads, the oldest
rows are dropped (a ``"dropped"`` event says how many; counters stay exact).

Overflow attribution (TensorFlow backend, single replica) is computed on the
device in the same step, with no eager re-run (so it names exactly what
happened in that step: same batch, weights, dropout masks): every layer's
``call`` is wrapped while training (restored at train end, and before a
:class:`~mp_callbacks.meters.DivergenceError` propagates) to probe its output
and, through an identity with a custom gradient on its floating inputs, the
gradient its backward produced; the loss is probed too, and on an overflow
step the optimizer's gradients give per-layer parameter flags.
The culprit is the first non-finite record in this order: forward outputs in
call order, then the loss (:data:`~mp_callbacks.monitor_helpers.LOSS_SOURCE`),
then layers in reverse call order (input gradient or own parameter
gradients) -- the core's :func:`~mp_callbacks.monitor_helpers.first_culprit`, as in
Lightning.  Layers called inside control
flow (``tf.cond``/``while`` bodies, e.g. RNN cells) are checked as a whole by
their enclosing layer.  Names are dotted layer paths as in
:func:`keras_ext.layer_dtype_policies` (``"encoder.dense_1"``).  On the torch
backend (eager steps) the same code runs eagerly, without the input-gradient
identities (a backward-only overflow is then blamed through parameter
gradients).  Under a multi-replica ``tf.distribute`` strategy the optimizer
does not call the hook: meters, attribution and the per-overflow rows are off,
and each record takes the optimizer's variables at the read (``mp/scale`` is
then the scale *after* the step, ``mp/overflow`` means "an overflow since the
previous record").

Persistence: :meth:`state_dict` is plain data (schema tag, version, step and
the core's history/guard/fallback state); :meth:`save_state` /
:meth:`load_state` write and read it as JSON, and ``state_path=`` does that
automatically (loaded at train start when the file exists, written at every
epoch end and at train end).  A restored fallback is applied again at train
start.
"""

from __future__ import annotations

import json
import logging
import os
import warnings
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping, Optional

import keras
import numpy as np
from keras import ops

from mp_callbacks.diagnostics import METRICS, OVERFLOW_MODULE, StepStats, json_safe
from mp_callbacks.dtypes import canonical_dtype
from mp_callbacks.master import MasterPlan, MemoryEstimate, estimate_memory, optimizer_kind, optimizer_slots
from mp_callbacks.meters import METER_SAMPLES, DivergenceError
from mp_callbacks.monitor import MONITOR_SCHEMA_VERSION, MonitorFacade  # version: re-exported
from mp_callbacks.monitor_helpers import attribution_order, swamp_storage_dtype
from mp_callbacks.recipes import Recipe, get_recipe

from . import policy as _policy
from .policy import _own_variables, _walk
from .keras_meters import grad_norm, sample, swamped_counts, underflow_counts
from .optimizer import LossScaleOptimizer

__all__ = ["MEMORY_BYTES_PER_PARAM", "MEMORY_ESTIMATE_BYTES_PER_PARAM", "MONITOR_SCHEMA",
           "MONITOR_SCHEMA_VERSION", "MixedPrecisionMonitor"]

logger = logging.getLogger(__name__)

MONITOR_SCHEMA = "keras_ext.MixedPrecisionMonitor"
"""The ``schema`` tag of the monitor's state record."""

MEMORY_BYTES_PER_PARAM = "mp/memory_bytes_per_param"
"""Put into the logs at train start: bytes of model state actually held per parameter."""
MEMORY_ESTIMATE_BYTES_PER_PARAM = "mp/memory_bytes_per_param_estimate"
"""Next to it: the core's :func:`~mp_callbacks.master.estimate_memory` for the same parameters."""

NUMERIC_METRICS = tuple(m for m in METRICS if m != OVERFLOW_MODULE)

# layout of the device stats vector
_S_SCALE, _S_FOUND, _S_NORM, _S_LOST, _S_TOTAL, _S_VALID = range(6)
_N_STATS = 6
# layout of a ring-buffer row
_R_STEP, _R_SCALE, _R_OVERFLOWS, _R_SKIPPED, _R_GROWTHS, _R_CULPRIT, _R_GEN = range(7)
_N_RING = 7
_COUNTERS = ("overflows", "skipped", "growths")


def _is_tf() -> bool:
    return keras.backend.backend() == "tensorflow"


def _flatten(value: Any) -> Iterator[Any]:
    if isinstance(value, Mapping):
        for v in value.values():
            yield from _flatten(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _flatten(v)
    elif value is not None:
        yield value


def _is_float_tensor(x: Any) -> bool:
    dtype = getattr(x, "dtype", None)
    if dtype is None or isinstance(x, keras.Variable):
        return False
    try:
        return keras.backend.standardize_dtype(dtype) in ("float16", "bfloat16", "float32", "float64")
    except Exception:
        return False


def _bad(tensors: Iterator[Any]) -> Any:
    """A 0-d bool: any floating tensor in ``tensors`` holds an inf/NaN (None if there is none)."""
    flag = None
    for t in tensors:
        if _is_float_tensor(t):
            b = ops.logical_not(ops.all(ops.isfinite(t)))
            flag = b if flag is None else ops.logical_or(flag, b)
    return flag


def _probe(tensors: Iterator[Any]) -> Any:
    """One float32 scalar per call, non-finite iff some floating tensor in ``tensors`` is (None if none).

    The sum (accumulated in float32) carries any inf/NaN; it is the cheapest
    per-step probe (one reduction, no boolean temporaries).  It can also turn
    inf without a non-finite element only when the values sum past 3.4e38,
    itself an overflow in the making.  The finite test of the probes runs on
    overflow steps only.
    """
    total = None
    for t in tensors:
        if _is_float_tensor(t):
            if keras.backend.standardize_dtype(t.dtype) != "float32":
                t = ops.cast(t, "float32")
            s = ops.sum(t)
            total = s if total is None else total + s
    return total


def _nonfinite(probe: Any) -> Any:
    return ops.logical_not(ops.isfinite(probe))


def _nbytes(v: Any) -> int:
    shape = tuple(int(d) for d in v.shape)
    size = int(np.prod(shape)) if shape else 1
    return size * np.dtype(keras.backend.standardize_dtype(v.dtype)).itemsize


def _numel(v: Any) -> int:
    shape = tuple(int(d) for d in v.shape)
    return int(np.prod(shape)) if shape else 1


def _current_graph() -> Any:
    if not _is_tf():
        return None
    import tensorflow as tf

    return None if tf.executing_eagerly() else tf.compat.v1.get_default_graph()


@dataclass
class _Trace:
    """Attribution records of one traced (or eager) train step."""

    graph: Any
    forward: list[tuple[str, Any]] = field(default_factory=list)
    backward: list[tuple[str, Any]] = field(default_factory=list)
    loss: Any = None


class _DeviceState:
    """The monitor's device variables (a plain object: never saved with the optimizer)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.request = keras.Variable(0, dtype="int32", trainable=False, name="mp_monitor_request")
        self.stats = keras.Variable(np.zeros(_N_STATS), dtype="float64", trainable=False, autocast=False,
                                    name="mp_monitor_stats")
        self.ring = keras.Variable(np.zeros((capacity, _N_RING)), dtype="float64", trainable=False,
                                   autocast=False, name="mp_monitor_overflows")
        self.count = keras.Variable(0.0, dtype="float64", trainable=False, autocast=False,
                                    name="mp_monitor_overflow_count")


class MixedPrecisionMonitor(MonitorFacade, keras.callbacks.Callback):
    """Mixed-precision diagnostics for :class:`keras_ext.LossScaleOptimizer`, with the shared metric names.

    Args:
      log_every_n_steps: write a full record (all shared metrics) every N
        steps; overflow steps are always recorded (at the next read, see the
        module docstring).  Between logging steps no host sync is added.
      divergence_patience: raise :class:`~mp_callbacks.meters.DivergenceError`
        after this many consecutive overflows with the scale at its floor
        (None: never); the message names the scale, the step, the first
        non-finite layer and a checklist.
      auto_fallback_after: after this many overflows blamed on the same layer,
        give it (and its sub-layers) the ``float32`` dtype policy (None: never).
        Keras cannot change the dtype of built variables, so this needs the
        layer's variables in float32 (``*-mixed`` recipes, where only the
        compute dtype changes); under ``*-master`` it logs that the layer must
        be rebuilt with ``apply_policy(model, policy.with_fp32_modules(path))``.
      attribute_overflows: name the first non-finite layer of overflow steps
        (one in-graph reduction per layer output and input gradient every step).
        Default None: on exactly when ``auto_fallback_after`` is set.
      measure_grads: ``mp/grad_norm`` and ``mp/grad_underflow_frac`` on logging steps.
      measure_swamping: ``mp/update_swamped_frac`` on logging steps.
      meter_samples: elements per tensor that the underflow and swamping
        meters read (a strided sample, :func:`mp_callbacks.meters.sample_stride`),
        which bounds a logging step's cost per tensor; ``None`` reads every element.
        ``mp/grad_norm`` always reads every element.
      log_memory: compute :meth:`memory_report` at train start and end.
      compute_dtype: the low-precision compute dtype of the underflow rule
        (default: the compute dtype of keras_ext's / Keras' global policy at train start).
      state_path: a JSON file holding :meth:`state_dict` (loaded at train start
        when present, written at each epoch end and at train end).
      overflow_buffer: device rows for overflow steps between two reads.
      history_maxlen: records kept in :attr:`history`.

    While attached, the monitor turns on the optimizer's per-step overflow check
    for recipes without loss scaling (``mp/overflow``, ``mp/overflows_total``
    count inf/NaN gradients there too; see
    :func:`mp_callbacks.scaler.checks_overflow`): one pass over the gradients
    per step, the monitor's main per-step cost under bf16 recipes.

    Put the monitor *before* ``TensorBoard``/``CSVLogger`` in ``callbacks`` so
    that they see the names it adds to ``logs``.  With ``steps_per_execution=k``
    Keras calls back once per k steps: a logging record is then the last
    step of an execution that contains a logging step (overflow rows stay
    per step).

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
                 meter_samples: Optional[int] = METER_SAMPLES) -> None:
        super().__init__()
        self._setup(log_every_n_steps, divergence_patience, auto_fallback_after, attribute_overflows,
                    measure_grads, measure_swamping, log_memory, history_maxlen, meter_samples)
        if not isinstance(overflow_buffer, int) or overflow_buffer < 1:
            raise ValueError(f"overflow_buffer={overflow_buffer!r} must be an integer >= 1")
        self.compute_dtype = canonical_dtype(compute_dtype) if compute_dtype else None
        self.state_path = os.fspath(state_path) if state_path is not None else None
        self.overflow_buffer = overflow_buffer
        self._last_seen = 0
        self._ring_seen = 0
        self._dev: Optional[_DeviceState] = None
        self._opt: Optional[LossScaleOptimizer] = None
        self._compute = "float32"
        self._trace: Optional[_Trace] = None
        self._generation = 0
        self._tables: dict[int, list[str]] = {}
        self._owners: dict[int, str] = {}
        self._patched: list[tuple[Any, str]] = []
        self._logging_now = False
        self._begin_step = 0
        self._before: list[Any] = []
        self._swamp: Optional[tuple[list[tuple[int, str]], Any]] = None
        self._fallback_messages: list[str] = []
        self._hooked = True
        self._overflows_seen = 0

    # ------------------------------------------------------------------ API
    # history, log_every_n_steps, step, state_dict, load_state_dict, repr: MonitorFacade
    def _optimizer(self) -> LossScaleOptimizer:
        opt = getattr(self.model, "optimizer", None)
        if not isinstance(opt, LossScaleOptimizer):
            raise TypeError(
                "keras_ext.MixedPrecisionMonitor reads the loss scaler of keras_ext.LossScaleOptimizer, but the "
                f"model is compiled with {type(opt).__name__}. Compile with "
                "keras_ext.LossScaleOptimizer(keras.optimizers.Adam(), 'keras') or keras_ext.master_optimizer(...)."
            )
        return opt

    # ------------------------------------------------------------- lifecycle
    def on_train_begin(self, logs: Optional[dict] = None) -> None:
        """Load state, read the step counter, install the hooks (retrace), log memory.

        Hooks left behind by a run that failed are removed first (:meth:`uninstall`).
        """
        self._uninstall()
        opt = self._optimizer()
        self._opt = opt
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
        if _is_tf() and strategy is not None:
            with strategy.scope():
                self._dev = _DeviceState(self.overflow_buffer)
        else:
            self._dev = _DeviceState(self.overflow_buffer)
        self._compute = self.compute_dtype or canonical_dtype(_policy.get_global_policy().compute)
        self._step = self._last_seen = opt.steps
        self._ring_seen = 0
        if self.core.fallback is not None:
            for path in self.core.fallback.moved:
                self._move_to_fp32(path, announce=False)
        self._install()
        if self.log_memory:
            self._log_memory("train_start", logs)

    def on_train_end(self, logs: Optional[dict] = None) -> None:
        """Record what is left, log memory, remove the hooks, save the state file."""
        try:
            self._drain()
            if self.log_memory:
                self._log_memory("train_end", logs)
        finally:
            self._uninstall()
        if self.state_path:
            self.save_state(self.state_path)

    def on_train_batch_begin(self, batch: int, logs: Optional[dict] = None) -> None:
        """On a logging step: ask for the gradient meters, snapshot the weights to update."""
        self._begin_step = batch
        n = self._steps_per_execution()
        self._logging_now = any(self.core.should_log(k) for k in range(self._step + 1, self._step + n + 1))
        if not self._logging_now:
            return
        if self.measure_grads:
            self._dev.request.assign(1)
        if self.measure_swamping:
            targets = self._swamp_targets()
            key = [(id(t), st) for t, st in targets]
            if self._swamp is None or self._swamp[0] != key:  # compiled once, again after a fallback
                self._swamp = (key, self._swamp_function(targets))
            self._before = [ops.copy(sample(t, self.meter_samples)) for t, _ in targets]  # the sampled elements

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
        """Record pending overflow rows; the epoch's last step goes into the epoch ``logs``."""
        snapshot = self._drain()
        if logs is not None and snapshot is not None:
            values = {name: float("nan") for name in NUMERIC_METRICS}
            values.update({k: v for k, v in snapshot.metrics().items() if k != OVERFLOW_MODULE})
            logs.update(values)
            if self.memory_reports:
                logs[MEMORY_BYTES_PER_PARAM] = float(self.memory_reports[-1]["actual"]["bytes_per_param"])
                est = self.memory_reports[-1]["estimate"]
                logs[MEMORY_ESTIMATE_BYTES_PER_PARAM] = float(est["bytes_per_param"]) if est else float("nan")
        if self.state_path:
            self.save_state(self.state_path)

    def _steps_per_execution(self) -> int:
        spe = getattr(self.model, "steps_per_execution", 1)
        return spe if isinstance(spe, int) and spe > 0 else 1

    # ---------------------------------------------------------- installing
    def _install(self) -> None:
        model, opt = self.model, self._opt
        self._owners = {}
        if self.attribute_overflows:
            for path, layer in _walk(model):
                for v in _own_variables(layer):
                    self._owners[id(v)] = path  # children come later: the innermost layer owns
                if "call" not in layer.__dict__:
                    layer.__dict__["call"] = self._wrap_call(layer.call, path)
                    self._patched.append((layer, "call"))
            if "_compute_loss" not in model.__dict__ and hasattr(model, "_compute_loss"):
                model.__dict__["_compute_loss"] = self._wrap_loss(model._compute_loss)
                self._patched.append((model, "_compute_loss"))
            if "train_step" not in model.__dict__:
                model.__dict__["train_step"] = self._wrap_train_step(model.train_step)
                self._patched.append((model, "train_step"))
        opt.set_stats_hook(self._hook)
        self._retrace()

    def uninstall(self) -> None:
        """Remove the monitor's wrappers and the optimizer's stats hook (idempotent).

        Runs at train end, before a :class:`~mp_callbacks.meters.DivergenceError`
        propagates and at the next train start; call it after a ``fit`` that
        raised to restore the model's layers and train step at once.
        """
        self._uninstall()

    def _uninstall(self) -> None:
        self._logging_now = False
        for obj, name in self._patched:
            obj.__dict__.pop(name, None)
        self._patched = []
        self._trace = None
        if self._opt is not None and self._opt.stats_hook == self._hook:
            self._opt.set_stats_hook(None)
            self._retrace()
        self._before = []

    def _retrace(self) -> None:
        if hasattr(self.model, "make_train_function"):
            self.model.make_train_function(force=True)

    def _wrap_train_step(self, original: Any) -> Any:
        monitor = self

        def train_step(data: Any) -> Any:
            graph = _current_graph()
            if graph is not None:
                monitor._generation += 1
            monitor._trace = _Trace(graph=graph)
            try:
                return original(data)
            finally:
                monitor._trace = None

        return train_step

    def _active(self) -> Optional[_Trace]:
        trace = self._trace
        if trace is None or _current_graph() is not trace.graph:
            return None
        return trace

    def _wrap_loss(self, original: Any) -> Any:
        monitor = self

        def _compute_loss(*args: Any, **kwargs: Any) -> Any:
            loss = original(*args, **kwargs)
            trace = monitor._active()
            if trace is not None and kwargs.get("training", True):
                trace.loss = _probe(iter((loss,)))
            return loss

        return _compute_loss

    def _wrap_call(self, original: Any, path: str) -> Any:
        monitor = self

        def call(*args: Any, **kwargs: Any) -> Any:
            trace = monitor._active()
            if trace is None:
                return original(*args, **kwargs)
            if _is_tf():
                args, kwargs = monitor._watch_inputs((args, kwargs), path, trace)
            out = original(*args, **kwargs)
            probe = _probe(_flatten(out))
            if probe is not None:
                trace.forward.append((path, probe))
            return out

        return call

    def _watch_inputs(self, structure: Any, path: str, trace: _Trace) -> Any:
        """Identity on every floating input tensor whose gradient records "non-finite" for ``path``."""
        import tensorflow as tf

        def watch(x: Any) -> Any:
            if not (isinstance(x, tf.Tensor) and x.dtype.is_floating):
                return x

            @tf.custom_gradient
            def identity(t: Any) -> Any:
                def grad(dy: Any) -> Any:
                    probe = _probe(iter((dy,)))
                    if probe is not None:
                        trace.backward.append((path, probe))
                    return dy

                return tf.identity(t), grad

            return identity(x)

        return tf.nest.map_structure(watch, structure)

    # -------------------------------------------------------- the device hook
    def _hook(self, found_inf: Any, grads: list[Any], tvs: list[Any], scale_used: Any) -> None:
        """Called by the optimizer inside the (traced) step: device writes only."""
        dev, opt = self._dev, self._opt
        if dev is None or opt is None:
            return
        found = ops.convert_to_tensor(found_inf)
        scale64 = ops.cast(scale_used, "float64")
        found64 = ops.cast(found, "float64")
        dense = [g for g in grads if g is not None]
        compute = self._compute
        nan = ops.convert_to_tensor(float("nan"), dtype="float64")

        def basic() -> None:
            dev.stats.assign(ops.stack([scale64, found64, nan, nan, nan, ops.cast(0.0, "float64")]))

        def meters() -> None:
            lost, total = underflow_counts(dense, compute, scale64, self.meter_samples)
            dev.stats.assign(ops.stack([scale64, found64, grad_norm(dense), lost, total,
                                        ops.cast(1.0, "float64")]))

        if self.measure_grads and dense:
            ops.cond(ops.greater(ops.convert_to_tensor(dev.request), 0), meters, basic)
        else:
            basic()

        trace = self._active() if self.attribute_overflows else None
        generation = self._generation

        def write() -> None:
            culprit = self._culprit(trace, grads, tvs, generation) if trace is not None else None
            culprit = ops.cast(-1.0 if culprit is None else culprit, "float64")
            sv = opt._state_vars
            row = ops.stack([ops.cast(ops.convert_to_tensor(sv["steps"]), "float64"), scale64]
                            + [ops.cast(ops.convert_to_tensor(sv[c]), "float64") for c in _COUNTERS]
                            + [culprit, ops.cast(float(generation), "float64")])
            count = ops.convert_to_tensor(dev.count)
            index = ops.mod(count, float(dev.capacity))
            hit = ops.expand_dims(ops.equal(ops.cast(ops.arange(dev.capacity), "float64"), index), 1)
            dev.ring.assign(ops.where(hit, ops.expand_dims(row, 0), ops.convert_to_tensor(dev.ring)))
            dev.count.assign(count + 1.0)

        ops.cond(found, write, lambda: None)

    def _culprit(self, trace: _Trace, grads: list[Any], tvs: list[Any], generation: int) -> Any:
        """Index (into this trace's name table) of the first non-finite record, -1 if none (device).

        The table is the core's :func:`~mp_callbacks.monitor_helpers.attribution_order` (forward
        records in call order, the loss, layers with gradient flags in reverse call order: the
        backward order), so the first flagged entry is :func:`~mp_callbacks.monitor_helpers.first_culprit`.
        """
        forward_flags = [_nonfinite(probe) for _, probe in trace.forward]
        loss_flag = _nonfinite(trace.loss) if trace.loss is not None else ops.convert_to_tensor(False)
        order: list[str] = []
        for path, _ in trace.forward:
            if path not in order:
                order.append(path)
        backward: dict[str, list[Any]] = {}
        for g, v in zip(grads, tvs):
            path = self._owners.get(id(v))
            if g is None or path is None:
                continue
            flag = _bad(iter((getattr(g, "values", g),)))
            if flag is not None:
                backward.setdefault(path, []).append(flag)
        for path, probe in trace.backward:
            backward.setdefault(path, []).append(_nonfinite(probe))
        for path in list(backward):
            if path not in order:
                order.append(path)
        backward_names = [path for path in reversed(order) if path in backward]  # backward order
        backward_flags = []
        for path in backward_names:
            bad = backward[path][0]
            for f in backward[path][1:]:
                bad = ops.logical_or(bad, f)
            backward_flags.append(bad)
        names = attribution_order([path for path, _ in trace.forward], backward_names)
        flags = [*forward_flags, loss_flag, *backward_flags]
        self._tables[generation] = names
        stacked = ops.stack([ops.cast(f, "int32") for f in flags])
        n = len(flags)
        first = ops.min(ops.where(ops.greater(stacked, 0), ops.arange(n, dtype="int32"), n))
        return ops.where(ops.less(first, n), first, -1)

    # -------------------------------------------------------------- reading
    def _recipe(self) -> Recipe:
        """The recipe in force: keras_ext's active one, else the one matching the compute dtype and optimizer."""
        recipe = _policy._ACTIVE.get("recipe")
        if recipe is not None:
            return recipe
        if self._compute == "float32":
            return get_recipe("32-true")
        prefix = "bf16" if self._compute == "bfloat16" else "16"
        return get_recipe(f"{prefix}-{'master' if self._opt.master_weights else 'mixed'}")

    def _swamp_targets(self) -> list[tuple[Any, str]]:
        """(the variable the optimizer updates, the dtype its update is measured against).

        The dtype is the core's :func:`~mp_callbacks.monitor_helpers.swamp_storage_dtype`; a
        variable counts as kept in FP32 when its layer computes in float32 (policy or fallback).
        """
        opt = self._opt
        recipe = self._recipe()
        masters = opt.master_variables if opt.master_weights else []
        kept: dict[int, bool] = {}
        for _, layer in _walk(self.model):
            fp32 = canonical_dtype(layer.dtype_policy.compute_dtype) == "float32"
            for v in _own_variables(layer):
                kept[id(v)] = fp32
        out = []
        for v in self.model.trainable_variables:
            stored = canonical_dtype(keras.backend.standardize_dtype(v.dtype))
            master = masters[opt._get_variable_index(v)] if masters else None
            target = master if master is not None else v  # the FP32 master under *-master
            out.append((target, swamp_storage_dtype(recipe, stored, kept.get(id(v), stored == "float32"))))
        return out

    def _swamp_function(self, targets: list[tuple[Any, str]]) -> Any:
        """One compiled function ``befores -> (lost, total)`` (float64) for these targets."""
        storages = [s for _, s in targets]

        def counts(befores: list[Any]) -> Any:
            updates = [ops.subtract(ops.cast(sample(t, self.meter_samples), "float32"), ops.cast(b, "float32"))
                       for (t, _), b in zip(targets, befores)]
            return ops.stack(list(swamped_counts(befores, updates, storages)))

        if _is_tf():
            import tensorflow as tf

            counts = tf.function(tf.autograph.experimental.do_not_convert(counts), reduce_retracing=True)
        return counts

    def _drain(self, logging: bool = False) -> Optional[StepStats]:
        """One read: record the overflow rows since the last read, then (``logging``) this step's record.

        Returns the record of the current step (None before the first step).
        """
        dev, opt = self._dev, self._opt
        if dev is None or opt is None:
            return None
        parts = [ops.cast(ops.convert_to_tensor(dev.stats), "float64")]
        parts.append(ops.stack([ops.cast(ops.convert_to_tensor(opt._state_vars[c]), "float64") for c in _COUNTERS]))
        parts.append(ops.reshape(ops.convert_to_tensor(dev.count), (1,)))
        parts.append(ops.reshape(ops.cast(ops.convert_to_tensor(opt._state_vars["scale"]), "float64"), (1,)))
        swamp = False
        if logging and self._before and self._swamp is not None:
            if self.measure_grads:
                dev.request.assign(0)
            parts.append(self._swamp[1](self._before))
            swamp = True
        elif logging and self.measure_grads:
            dev.request.assign(0)
        self._before = []
        parts.append(ops.reshape(ops.convert_to_tensor(dev.ring), (-1,)))
        read = np.asarray(ops.convert_to_numpy(ops.concatenate(parts)), dtype=np.float64)
        stats, counters = read[:_N_STATS], read[_N_STATS:_N_STATS + 3]
        at = _N_STATS + 3
        count = int(read[at])
        scale_now = float(read[at + 1])
        at += 2
        swamp_counts = read[at:at + 2] if swamp else None
        at += 2 if swamp else 0
        ring = read[at:].reshape(dev.capacity, _N_RING)

        rows = []
        new = count - self._ring_seen
        if new > 0:
            if new > dev.capacity:
                self.history.add_event("dropped", step=self._step, rows=new - dev.capacity)
            for k in range(max(self._ring_seen, count - dev.capacity), count):
                rows.append(ring[k % dev.capacity])
        self._ring_seen = count
        current: Optional[StepStats] = None
        current_module: Optional[str] = None
        for row in rows:  # the device hook writes one row per overflow step
            step = int(row[_R_STEP])
            if not self.core.should_record(step, overflow=True):
                continue
            module = self._culprit_name(row)
            if logging and step == self._step:
                current_module = module
                continue
            stats_row = StepStats.from_counts(step, row[_R_SCALE], True, row[_R_OVERFLOWS], row[_R_SKIPPED],
                                              row[_R_GROWTHS], overflow_module=module)
            self._observe(stats_row)
        if self._step == 0:
            return None
        if not self._hooked:  # multi-replica: no device hook, read the optimizer's variables
            stats = stats.copy()
            stats[_S_SCALE], stats[_S_FOUND] = scale_now, float(counters[0] > self._overflows_seen)
        self._overflows_seen = int(counters[0])
        overflow = bool(stats[_S_FOUND])
        measured = logging and stats[_S_VALID] == 1.0
        current = StepStats.from_counts(
            self._step, stats[_S_SCALE], overflow, counters[0], counters[1], counters[2],
            grad_norm=stats[_S_NORM] if measured else None,
            underflow=(stats[_S_LOST], stats[_S_TOTAL]) if measured else None,
            swamped=(swamp_counts[0], swamp_counts[1]) if swamp_counts is not None and not overflow else None,
            overflow_module=(current_module if overflow and self.attribute_overflows else None),
        )
        if logging:
            self._observe(current)
        elif self._step > self._last_seen:
            self.core.observe_clean()
            self._last_seen = self._step
        if self.history and self.history[-1].step == self._step:
            return self.history[-1]
        return current

    def _culprit_name(self, row: np.ndarray) -> Optional[str]:
        index = int(row[_R_CULPRIT])
        if not self.attribute_overflows or index < 0:
            return None
        table = self._tables.get(int(row[_R_GEN])) or []
        return table[index] if index < len(table) else None

    def _observe(self, stats: StepStats) -> None:
        """Guard bookkeeping for the steps skipped over, then record ``stats`` (maybe moving a layer)."""
        if stats.step > self._last_seen + 1:
            self.core.observe_clean()  # a clean, unrecorded step came in between
        self._last_seen = max(self._last_seen, stats.step)
        try:
            moved = self.core.record(stats, float(self._opt.scaler_config.min_scale))
        except DivergenceError:
            self._uninstall()
            raise
        for path in moved:
            self._move_to_fp32(path, announce=True, step=stats.step)

    # ------------------------------------------------------------ fallback
    def _find_layer(self, path: str) -> Any:
        for p, layer in _walk(self.model):
            if p == path:
                return layer
        return None

    def _move_to_fp32(self, path: str, announce: bool = True, step: Optional[int] = None) -> bool:
        """Give layer ``path`` and its sub-layers the float32 policy (compute only: variables must be float32)."""
        layer = self._find_layer(path)
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
        active = _policy._ACTIVE.get("policy")
        if active is not None:
            _policy._ACTIVE["policy"] = active.with_fp32_modules(path)
        self._retrace()
        if announce:
            blamed = self.core.fallback.blame.get(path) if self.core.fallback is not None else None
            message = (f"MixedPrecisionMonitor: {blamed} overflows blamed on {path!r}; it now computes in FP32 "
                       f"(dtype policy float32, policy: with_fp32_modules({path!r})). Training continues.")
            logger.warning(message)
            self.fallback_messages.append(message)
        return True

    @property
    def fallback_messages(self) -> list[str]:
        """The messages of the layers moved to FP32 by the auto-fallback in this process."""
        return self._fallback_messages

    # --------------------------------------------------------------- memory
    def memory_report(self) -> dict[str, Any]:
        """Bytes of model state actually held, next to the core's estimate (plain data).

        ``actual``: ``weights`` (the model's trainable variables), ``masters``
        (the optimizer's FP32 master copies), ``optimizer_state`` (every
        variable of the inner optimizer: slots, iteration count, learning
        rate), and ``grads``: *estimated*, since Keras keeps no gradients
        between steps: the FP32 unscaled gradient the optimizer applies for
        a variable with a master, the variable's dtype otherwise.
        ``estimate`` is :func:`mp_callbacks.master.estimate_memory` for the
        same variables and storage dtypes (None for an optimizer unknown to the
        core) with ``fp32_master_grads=True``, like the Lightning monitor's: it
        counts the FP32 gradient a variable with a master receives at the step
        (18 B/param for ``bf16-master`` + AdamW).
        """
        opt = self._opt or self._optimizer()
        tvs = list(self.model.trainable_variables)
        masters = opt.master_variables if opt.master_weights and opt.built else [None] * len(tvs)
        numel = sum(_numel(v) for v in tvs)
        weights = sum(_nbytes(v) for v in tvs)
        master_bytes = sum(_nbytes(m) for m in masters if m is not None)
        mastered = {id(v) for v, m in zip(tvs, masters) if m is not None} if masters else set()
        grads = sum(_numel(v) * 4 if id(v) in mastered else _nbytes(v) for v in tvs)
        state = sum(_nbytes(v) for v in opt.inner_optimizer.variables)
        inner = opt.inner_optimizer
        name = optimizer_kind(type(inner).__name__, float(getattr(inner, "momentum", 0.0) or 0.0))
        estimate = None
        try:
            optimizer_slots(name)
            recipe = _policy._ACTIVE.get("recipe")
            plan = recipe.master if recipe is not None else MasterPlan(
                param_dtype=_low_dtype(tvs), master_weights=opt.master_weights)
            est = estimate_memory(plan, name, [(_numel(v), canonical_dtype(keras.backend.standardize_dtype(v.dtype)))
                                               for v in tvs], fp32_master_grads=True)
            estimate = est.to_dict()
        except (ValueError, TypeError):
            name = f"{name} (unknown to the core)"
        actual = MemoryEstimate(params=numel, weights=weights, grads=grads, masters=master_bytes,
                                optimizer_state=state)
        return {"optimizer": name, "master_weights": opt.master_weights, "actual": actual.to_dict(),
                "estimate": estimate}

    def _log_memory(self, when: str, logs: Optional[dict]) -> None:
        report = self.memory_report()
        report["when"] = when
        self.memory_reports.append(report)
        self.history.add_event("memory", step=self._step, **report)
        if logs is not None:
            logs[MEMORY_BYTES_PER_PARAM] = float(report["actual"]["bytes_per_param"])
            if report["estimate"] is not None:
                logs[MEMORY_ESTIMATE_BYTES_PER_PARAM] = float(report["estimate"]["bytes_per_param"])

    # ---------------------------------------------------------- persistence
    # state_dict / load_state_dict: MonitorFacade
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


def _low_dtype(tvs: list[Any]) -> str:
    for v in tvs:
        d = keras.backend.standardize_dtype(v.dtype)
        if d in ("float16", "bfloat16"):
            return d
    return "float32"

