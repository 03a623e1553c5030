"""The Keras monitor's device record: what a traced train step writes for one later host read.

The Keras monitor cannot read device values in the step without a host sync,
so :meth:`keras_ext.MixedPrecisionMonitor.on_optimizer_step` writes them into
:class:`DeviceRecord` variables and the monitor reads them all at once on
logging steps and at epoch / train end.  Every vector has named slots
(:class:`~mp_callbacks.diagnostics.monitor.PackedLayout`), so nothing is addressed by
position.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import keras
import numpy as np
from keras import ops

from mp_callbacks.diagnostics import PackedLayout

from ..fp8 import is_fp8_variable
from ..ops import cond, is_jax, tracing
from .meters import grad_norm, underflow_counts

__all__ = ["COUNTERS", "DeviceRecord"]

COUNTERS = ("overflows", "skipped", "growths")
"""The scaler counters an overflow row and a read carry, in this order."""


def record_dtype() -> str:
    """float64; float32 on JAX without ``jax_enable_x64`` (steps and counts exact below 2**24)."""
    if keras.backend.backend() == "jax":
        import jax

        return "float64" if jax.config.jax_enable_x64 else "float32"
    return "float64"


def _slots(*names: str) -> PackedLayout:
    return PackedLayout((name, 1) for name in names)


class DeviceRecord:
    """The monitor's device variables, written inside the traced step and read in one host read.

    * ``stats``: the latest step, slots :attr:`STATS` (``measured`` is 1 when the meters ran);
    * ``ring``: one row per overflow step, slots :attr:`ROW`, ``capacity`` rows;
    * ``count``: rows written so far; ``request``: 1 asks the next step for the meters.

    A plain object (never saved with the optimizer); the variables are created
    in ``strategy``'s scope when one is given.  Every write follows the step's
    ``cond`` (branches return values), so the same code runs under
    ``tf.function``, eagerly and in the JAX trainer's jitted step.
    """

    STATS = _slots("scale", "found", "grad_norm", "underflow_lost", "underflow_total", "measured")
    ROW = _slots("step", "scale", "overflows", "skipped", "growths", "culprit", "generation")

    def __init__(self, capacity: int, strategy: Any = None) -> None:
        self.dtype = record_dtype()

        def f64(name: str, value: Any) -> keras.Variable:
            return keras.Variable(value, dtype=self.dtype, trainable=False, autocast=False, name=name)

        self.capacity = capacity
        self.seen = 0  # rows already read back
        self.asked = False  # the host's copy of ``request``
        with strategy.scope() if strategy is not None else contextlib.nullcontext():
            self.request = keras.Variable(0, dtype="int32", trainable=False, name="mp_monitor_request")
            self.stats = f64("mp_monitor_stats", np.zeros(self.STATS.size))
            self.ring = f64("mp_monitor_overflows", np.zeros((capacity, self.ROW.size)))
            self.count = f64("mp_monitor_overflow_count", 0.0)

    def ask(self, on: bool) -> None:
        """Set ``request`` (1: the next step runs the meters); the host keeps its own copy (eager JAX steps)."""
        self.request.assign(1 if on else 0)
        self.asked = on

    @property
    def variables(self) -> list[keras.Variable]:
        """All four variables (the optimizer's step state on JAX: :mod:`keras_ext.jax_support`)."""
        return [self.request, self.stats, self.ring, self.count]

    def stats_of(self, **values: Any) -> Any:
        """The ``stats`` vector of one device scalar per slot name (a value: branches return it)."""
        return ops.stack([ops.cast(values[name], self.dtype) for name in self.STATS.names])

    def write_step(self, found_inf: Any, grads: list[Any], tvs: list[Any], scale_used: Any, scaler: Any,
                   measure_grads: bool, compute: str, samples: int | None, attribution: Any = None) -> None:
        """A step's writes (inside the traced step; ``scale_used``: the scale the gradients were produced
        with): ``stats`` with the gradient meters when ``request`` asks and ``measure_grads`` (FP8 states
        have no gradients), and on an overflow a row with ``scaler``'s counters after the step and the
        first non-finite layer when ``attribution`` (a :class:`~keras_ext.diagnostics.attribution.LayerAttribution`)."""
        found = ops.convert_to_tensor(found_inf)
        dense = [g for g, v in zip(grads, tvs) if g is not None and not is_fp8_variable(v)]
        nan = ops.convert_to_tensor(float("nan"), dtype=self.dtype)

        def basic() -> Any:
            return self.stats_of(scale=scale_used, found=found, grad_norm=nan, underflow_lost=nan,
                                 underflow_total=nan, measured=0.0)

        def meters() -> Any:
            lost, total = underflow_counts(dense, compute, ops.cast(scale_used, self.dtype), samples)
            return self.stats_of(scale=scale_used, found=found, grad_norm=grad_norm(dense), underflow_lost=lost,
                                 underflow_total=total, measured=1.0)

        if not (measure_grads and dense):
            self.stats.assign(basic())
        elif is_jax() and not tracing(found):  # an eager JAX step: the host's copy, no read, no compiled cond
            self.stats.assign(meters() if self.asked else basic())
        else:
            self.stats.assign(ops.cond(ops.greater(ops.convert_to_tensor(self.request), 0), meters, basic))
        trace = attribution.current() if attribution is not None else None
        generation = attribution.generation if attribution is not None else 0

        def row() -> dict[str, Any]:
            culprit = attribution.culprit(trace, grads, tvs) if trace is not None else -1.0
            counters = {c: ops.convert_to_tensor(scaler.variable(c)) for c in COUNTERS}
            return dict(step=ops.convert_to_tensor(scaler.variable("steps")), scale=scale_used,
                        culprit=culprit, generation=float(generation), **counters)

        self.push_row_if(found, row)

    def push_row_if(self, found: Any, row: Callable[[], dict[str, Any]]) -> None:
        """Where the 0-d bool ``found`` holds, write ``row()`` (one device scalar per slot name) at
        ``count % capacity`` and count it.  The branches return values and the writes follow the
        ``cond`` (a JAX ``cond`` branch cannot write variables); ``row`` runs in the taken branch only."""
        ring, count = ops.convert_to_tensor(self.ring), ops.convert_to_tensor(self.count)

        def push() -> tuple[Any, Any]:
            values = row()
            new = ops.stack([ops.cast(values[name], self.dtype) for name in self.ROW.names])
            hit = ops.equal(ops.cast(ops.arange(self.capacity), self.dtype), ops.mod(count, float(self.capacity)))
            return ops.where(ops.expand_dims(hit, 1), ops.expand_dims(new, 0), ring), ops.add(count, 1.0)

        ring, count = cond(found, push, lambda: (ring, count))
        self.ring.assign(ring)
        self.count.assign(count)

    def read(self, counters: list[Any], scale: Any, extra: Any = None) -> dict[str, Any]:
        """One host read: ``stats`` (a dict), ``counters``, ``scale``, ``extra`` (a device vector,
        or None), the ``rows`` written since the last read (dicts, oldest first) and ``dropped``."""
        layout = PackedLayout([("stats", self.STATS.size), ("counters", len(counters)), ("count", 1), ("scale", 1)])
        parts = [self.stats, *counters, self.count, scale]
        if extra is not None:
            layout.add("extra", int(extra.shape[0]))
            parts.append(extra)
        layout.add("ring", self.capacity * self.ROW.size)
        parts.append(self.ring)
        flat = ops.concatenate([ops.reshape(ops.cast(ops.convert_to_tensor(p), self.dtype), (-1,)) for p in parts])
        got = layout.unpack(np.asarray(ops.convert_to_numpy(flat), dtype=np.float64))
        count = int(got["count"])
        ring = got["ring"].reshape(self.capacity, self.ROW.size)
        first = max(self.seen, count - self.capacity)
        got["rows"] = [self.ROW.unpack(ring[k % self.capacity]) for k in range(first, count)]
        got["dropped"] = max(0, count - self.seen - self.capacity)
        got["stats"] = self.STATS.unpack(got["stats"])
        self.seen = count
        return got
