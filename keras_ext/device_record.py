"""The Keras monitor's device record: what a traced train step writes for one later host read.

The Keras monitor cannot read device values in the step without a host sync,
so :meth:`keras_ext.MixedPrecisionMonitor.on_optimizer_step` writes them into
:class:`DeviceRecord` variables and the monitor reads them all at once on
logging steps and at epoch / train end.  Every vector has named slots
(:class:`~mp_callbacks.monitor.PackedLayout`), so nothing is addressed by
position.
"""

from __future__ import annotations

import contextlib
from typing import Any

import keras
import numpy as np
from keras import ops

from mp_callbacks.monitor import PackedLayout

__all__ = ["COUNTERS", "DeviceRecord"]

COUNTERS = ("overflows", "skipped", "growths")
"""The scaler counters an overflow row and a read carry, in this order."""


def _slots(*names: str) -> PackedLayout:
    return PackedLayout((name, 1) for name in names)


class DeviceRecord:
    """The monitor's device variables, written inside the traced step and read in one host read.

    * ``stats``: the latest step, slots :attr:`STATS` (``measured`` is 1 when the meters ran);
    * ``ring``: one row per overflow step, slots :attr:`ROW`, ``capacity`` rows;
    * ``count``: rows written so far; ``request``: 1 asks the next step for the meters.

    A plain object (never saved with the optimizer); the variables are created
    in ``strategy``'s scope when one is given.
    """

    STATS = _slots("scale", "found", "grad_norm", "underflow_lost", "underflow_total", "measured")
    ROW = _slots("step", "scale", "overflows", "skipped", "growths", "culprit", "generation")

    def __init__(self, capacity: int, strategy: Any = None) -> None:
        def f64(name: str, value: Any) -> keras.Variable:
            return keras.Variable(value, dtype="float64", trainable=False, autocast=False, name=name)

        self.capacity = capacity
        self.seen = 0  # rows already read back
        with strategy.scope() if strategy is not None else contextlib.nullcontext():
            self.request = keras.Variable(0, dtype="int32", trainable=False, name="mp_monitor_request")
            self.stats = f64("mp_monitor_stats", np.zeros(self.STATS.size))
            self.ring = f64("mp_monitor_overflows", np.zeros((capacity, self.ROW.size)))
            self.count = f64("mp_monitor_overflow_count", 0.0)

    def write_stats(self, **values: Any) -> None:
        """Assign ``stats`` from one device scalar per slot name."""
        self.stats.assign(ops.stack([ops.cast(values[name], "float64") for name in self.STATS.names]))

    def push_row(self, **values: Any) -> None:
        """Write one ring row (one device scalar per slot name) at ``count % capacity``; count it."""
        row = ops.stack([ops.cast(values[name], "float64") for name in self.ROW.names])
        count = ops.convert_to_tensor(self.count)
        hit = ops.equal(ops.cast(ops.arange(self.capacity), "float64"), ops.mod(count, float(self.capacity)))
        self.ring.assign(ops.where(ops.expand_dims(hit, 1), ops.expand_dims(row, 0), ops.convert_to_tensor(self.ring)))
        self.count.assign(count + 1.0)

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
        flat = ops.concatenate([ops.reshape(ops.cast(ops.convert_to_tensor(p), "float64"), (-1,)) for p in parts])
        got = layout.unpack(np.asarray(ops.convert_to_numpy(flat), dtype=np.float64))
        count = int(got["count"])
        ring = got["ring"].reshape(self.capacity, self.ROW.size)
        first = max(self.seen, count - self.capacity)
        got["rows"] = [self.ROW.unpack(ring[k % self.capacity]) for k in range(first, count)]
        got["dropped"] = max(0, count - self.seen - self.capacity)
        got["stats"] = self.STATS.unpack(got["stats"])
        self.seen = count
        return got
