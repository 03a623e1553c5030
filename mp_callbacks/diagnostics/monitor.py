"""What both frameworks' ``MixedPrecisionMonitor`` callbacks decide, written once.

An adapter's callback gathers numbers from its framework (scale, overflow
flag, counters, optional meters, the blamed module) and hands them to
:class:`MonitorCore`, which

* decides which steps get a full record (:meth:`MonitorCore.should_log`:
  every ``log_every_n_steps``-th step) and which are recorded at all
  (:meth:`MonitorCore.should_record`: those, and every overflow step);
* keeps the :class:`History` of :class:`~mp_callbacks.diagnostics.metrics.StepStats`
  (built by the adapters with :meth:`StepStats.from_counts`);
* records overflow attributions as history events (the blame order is
  :func:`~mp_callbacks.diagnostics.attribution.first_culprit`);
* runs the divergence guard (optional) and the auto-fallback tracker
  (optional), returning the modules to move to FP32 (never
  :data:`~mp_callbacks.diagnostics.attribution.LOSS_SOURCE`: the loss is no module);
* writes and checks the adapters' checkpoint envelope (:meth:`MonitorCore.envelope`,
  :meth:`MonitorCore.load_envelope`).

Host syncs: the adapters read device values only on logging steps and on
overflow steps (which the scaler already knows about on the host).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from ..loss_scale.config import ScalerConfig
from ..loss_scale.transition import check_count_overflows, checks_overflow
from .attribution import LOSS_SOURCE, FallbackTracker
from .divergence import DivergenceGuard
from .meters import METER_SAMPLES, check_samples
from .metrics import History, StepStats

MONITOR_SCHEMA_VERSION = 1
"""Version of :meth:`MonitorCore.state_dict` and of the adapters' envelope around it."""


class MonitorCore:
    """Logging cadence, history, divergence guard and auto-fallback for one run.

    Args:
      log_every_n_steps: log a full record every N steps (overflow steps always).
      divergence_patience: stop after this many consecutive overflows at the
        scale floor (None: never; otherwise an integer >= 1).
      auto_fallback_after: move a module to FP32 after this many overflows
        blamed on it (None: never; otherwise an integer >= 1).
      history_maxlen: records kept in memory.
    """

    def __init__(self, log_every_n_steps: int = 50, divergence_patience: int | None = None,
                 auto_fallback_after: int | None = None, history_maxlen: int = 100_000) -> None:
        if not isinstance(log_every_n_steps, int) or log_every_n_steps < 1:
            raise ValueError(f"log_every_n_steps={log_every_n_steps!r} must be an integer >= 1")
        self.log_every_n_steps = log_every_n_steps
        self.history = History(maxlen=history_maxlen)
        # None is "off"; 0 or a negative number is an error (raised by the guard / tracker)
        self.guard = DivergenceGuard(divergence_patience) if divergence_patience is not None else None
        self.fallback = FallbackTracker(auto_fallback_after) if auto_fallback_after is not None else None

    def should_log(self, step: int) -> bool:
        """True on every ``log_every_n_steps``-th step (1-based: steps N, 2N, ...)."""
        return step % self.log_every_n_steps == 0

    def should_record(self, step: int, overflow: bool) -> bool:
        """True when step ``step`` goes to :meth:`record`: every logging step and every overflow step.

        Other steps go to :meth:`observe_clean`.
        """
        return bool(overflow) or self.should_log(step)

    def record(self, stats: StepStats, min_scale: float = 0.0) -> list[str]:
        """Keep ``stats``; returns the modules that must move to FP32 now (auto-fallback).

        An overflow blamed on :data:`~mp_callbacks.diagnostics.attribution.LOSS_SOURCE`
        is recorded but never counts towards a fallback (the loss is no module).
        Raises :class:`~mp_callbacks.diagnostics.meters.DivergenceError` from the guard.
        """
        self.history.append(stats)
        moved: list[str] = []
        if stats.overflow:
            self.history.add_event("overflow", step=stats.step, scale=stats.scale,
                                   module=stats.overflow_module)
            if self.fallback is not None and stats.overflow_module and stats.overflow_module != LOSS_SOURCE:
                if self.fallback.blame_module(stats.overflow_module):
                    moved.append(stats.overflow_module)
                    self.history.add_event("fallback", step=stats.step, module=stats.overflow_module,
                                           overflows=self.fallback.blame[stats.overflow_module])
        if self.guard is not None:
            self.guard.observe(stats.step, stats.scale, min_scale, stats.overflow, stats.overflow_module)
        return moved

    def record_policy(self, rows: list[dict[str, str]], step: int) -> str:
        """Keep a policy report (rows of :func:`~mp_callbacks.policy.format_report`) as a history event;
        returns the text to print."""
        from ..policy import format_report

        self.history.add_event("policy", step=step, modules=rows)
        return "mixed-precision policy:\n" + format_report(rows)

    def fallback_message(self, path: str) -> str:
        """The announcement of a module moved to FP32 by the auto-fallback (both frameworks)."""
        blamed = self.fallback.blame.get(path) if self.fallback is not None else None
        return (f"MixedPrecisionMonitor: {blamed} overflows blamed on {path!r}; it now computes in FP32 "
                f"(policy: with_fp32_modules({path!r})). Training continues.")

    def observe_clean(self) -> None:
        """A clean step that is not logged: only the guard's streak needs to know."""
        if self.guard is not None:
            self.guard.streak = 0

    # -- checkpoints ------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Plain data: schema version, the history, and the guard's / tracker's state (None when off)."""
        return {
            "schema_version": MONITOR_SCHEMA_VERSION,
            "history": self.history.state_dict(),
            "guard": self.guard.state_dict() if self.guard else None,
            "fallback": self.fallback.state_dict() if self.fallback else None,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a :meth:`state_dict`; another schema version is a ``ValueError``.

        The guard's / tracker's state is restored only when this core has one
        (the constructor's arguments decide whether they run).
        """
        version = state.get("schema_version") if isinstance(state, Mapping) else None
        if version != MONITOR_SCHEMA_VERSION:
            raise ValueError(f"monitor state has schema_version={version!r}; expected {MONITOR_SCHEMA_VERSION}")
        self.history.load_state_dict(state["history"])
        if self.guard is not None and state.get("guard"):
            self.guard.load_state_dict(state["guard"])
        if self.fallback is not None and state.get("fallback"):
            self.fallback.load_state_dict(state["fallback"])

    # -- the adapters' checkpoint envelope ----------------------------------------------
    def envelope(self, schema: str, step: int) -> dict[str, Any]:
        """An adapter's checkpoint record: ``{"schema", "schema_version", "step", "core": state_dict()}``.

        ``schema`` names the adapter (``"lightning_ext.MixedPrecisionMonitor"``),
        ``step`` is its step count.
        """
        return {"schema": schema, "schema_version": MONITOR_SCHEMA_VERSION, "step": int(step),
                "core": self.state_dict()}

    def load_envelope(self, schema: str, state: Any, what: str = "checkpoint") -> int:
        """Check and restore an :meth:`envelope`; returns its step count.

        Another ``schema`` tag or version is a ``ValueError`` naming both
        (``what``: the word for the record in the message, e.g. ``"state"``).
        """
        if not isinstance(state, Mapping) or state.get("schema") != schema:
            found = state.get("schema") if isinstance(state, Mapping) else type(state).__name__
            raise ValueError(f"the {what} holds monitor schema {found!r}; this callback reads {schema!r}")
        if state.get("schema_version") != MONITOR_SCHEMA_VERSION:
            raise ValueError(f"the {what} holds {schema} schema v{state.get('schema_version')!r}; "
                             f"this version reads v{MONITOR_SCHEMA_VERSION}")
        self.load_state_dict(state["core"])
        return int(state.get("step", 0))

    def arguments(self) -> str:
        """The constructor arguments that shape behaviour, as ``name=value, ...`` (for the adapters' repr)."""
        return (f"log_every_n_steps={self.log_every_n_steps}, "
                f"divergence_patience={self.guard.patience if self.guard else None}, "
                f"auto_fallback_after={self.fallback.threshold if self.fallback else None}")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.arguments()})"


class MonitorFacade:
    """The public face both adapters' ``MixedPrecisionMonitor`` callbacks share (a mixin, listed first).

    The adapter sets :attr:`core` (a :class:`MonitorCore`), ``_step`` (its
    step count) and the class attributes :attr:`SCHEMA` (its checkpoint tag)
    and :attr:`STATE_WORD` (what its error messages call the record).
    """

    SCHEMA: str = ""
    STATE_WORD: str = "checkpoint"
    core: MonitorCore
    _step: int

    def _setup(self, log_every_n_steps: int, divergence_patience: int | None, auto_fallback_after: int | None,
               attribute_overflows: bool | None, measure_grads: bool, measure_swamping: bool, log_memory: bool,
               history_maxlen: int, meter_samples: int | None = METER_SAMPLES, report_policy: bool = False) -> None:
        """The constructor arguments both adapters take: the core, the switches, an empty run.

        ``attribute_overflows=None`` (the default) turns attribution on exactly when
        ``auto_fallback_after`` is set (fallback needs a culprit): attribution checks
        every module's output and gradients on every step, which costs far more
        than the rest of the monitor (see ``benchmarks/``), so it is opt-in.
        """
        self.core = MonitorCore(log_every_n_steps=log_every_n_steps, divergence_patience=divergence_patience,
                                auto_fallback_after=auto_fallback_after, history_maxlen=history_maxlen)
        if attribute_overflows is None:
            attribute_overflows = auto_fallback_after is not None
        self.attribute_overflows = bool(attribute_overflows)
        self.measure_grads = bool(measure_grads)
        self.measure_swamping = bool(measure_swamping)
        self.meter_samples = check_samples(meter_samples)
        self.log_memory = bool(log_memory)
        self.report_policy = bool(report_policy)
        self.memory_reports: list[dict[str, Any]] = []
        self._step = 0

    @property
    def history(self) -> History:
        """The run's :class:`~mp_callbacks.diagnostics.metrics.History` (steps and events)."""
        return self.core.history

    @property
    def log_every_n_steps(self) -> int:
        """The logging cadence."""
        return self.core.log_every_n_steps

    @property
    def step(self) -> int:
        """Scaler transitions seen so far (the last recorded or skipped step's number)."""
        return self._step

    def state_dict(self) -> dict[str, Any]:
        """Plain data: the core's :meth:`MonitorCore.envelope` (schema tag and version, the step
        count and the core's history/guard/fallback state)."""
        return self.core.envelope(self.SCHEMA, self._step)

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore a :meth:`state_dict`; another schema or version is an error naming both."""
        self._step = self.core.load_envelope(self.SCHEMA, state_dict, self.STATE_WORD)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.core.arguments()})"


class PackedLayout:
    """Named slots of one flat float64 vector: many device values, one host read.

    A monitor adds a slot per value it needs (:meth:`add`), stacks the device
    values in slot order with its framework, reads the vector once and gets the
    numbers back by name (:meth:`unpack`).  A slot of size 1 unpacks to a float,
    a larger one to a NumPy array.

    >>> layout = PackedLayout([("scale", 1), ("counts", 2)])
    >>> layout.unpack([8.0, 1.0, 2.0])["counts"].tolist()
    [1.0, 2.0]
    """

    def __init__(self, slots: Iterable[tuple[str, int]] = ()) -> None:
        self._slots: dict[str, tuple[int, int]] = {}
        self.size = 0
        for name, size in slots:
            self.add(name, size)

    def add(self, name: str, size: int = 1) -> None:
        """Append slot ``name`` of ``size`` elements; a name may appear once."""
        if name in self._slots:
            raise ValueError(f"slot {name!r} is already in the layout")
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"slot {name!r} needs a size >= 1, not {size!r}")
        self._slots[name] = (self.size, size)
        self.size += size

    @property
    def names(self) -> list[str]:
        """Slot names in packing order."""
        return list(self._slots)

    def __contains__(self, name: object) -> bool:
        return name in self._slots

    def index(self, name: str) -> int:
        """The offset of slot ``name`` in the vector."""
        return self._slots[name][0]

    def unpack(self, vector: Sequence[float] | np.ndarray) -> dict[str, Any]:
        """``{name: float or array}`` from a read vector of exactly :attr:`size` elements."""
        flat = np.asarray(vector, dtype=np.float64).reshape(-1)
        if flat.size != self.size:
            raise ValueError(f"read {flat.size} values for a layout of {self.size}")
        return {name: (float(flat[at]) if n == 1 else flat[at:at + n].copy()) for name, (at, n) in self._slots.items()}


class MonitorPort:
    """Where a diagnostics monitor attaches: the Lightning plugin and the Keras optimizer (a mix-in).

    One monitor at a time (attaching another replaces it).  While one is
    attached, steps without loss scaling look for inf/NaN gradients too
    (:attr:`checks_overflow`).  The owner provides :attr:`scaler_config`.
    """

    _monitor: Any = None
    _count_overflows: bool | None = None

    @property
    def scaler_config(self) -> ScalerConfig:  # pragma: no cover - provided by the owner
        raise NotImplementedError

    @property
    def count_overflows(self) -> bool | None:
        """With scaling off, whether every step counts inf/NaN gradients (None: while a monitor is attached)."""
        return self._count_overflows

    @count_overflows.setter
    def count_overflows(self, value: bool | None) -> None:
        self._count_overflows = check_count_overflows(value)

    @property
    def monitor(self) -> Any:
        """The attached monitor, or None."""
        return self._monitor

    @property
    def monitored(self) -> bool:
        """True while a monitor is attached."""
        return self._monitor is not None

    def attach_monitor(self, monitor: Any) -> None:
        """Attach ``monitor`` (replacing any other)."""
        self._monitor = monitor

    def detach_monitor(self, monitor: Any) -> None:
        """Detach ``monitor`` if it is the attached one (idempotent)."""
        if self._monitor is monitor:
            self._monitor = None

    @property
    def checks_overflow(self) -> bool:
        """True when steps look for inf/NaN gradients: :func:`mp_callbacks.loss_scale.scaler.checks_overflow`."""
        return checks_overflow(self.scaler_config, self._count_overflows, self.monitored)
