"""The core's diagnostics in Lightning: the monitor callbacks, the meters, overflow attribution, memory held.

The concept (the core's :mod:`mp_callbacks.diagnostics` and :mod:`mp_callbacks.memory`): the shared metric
names (``mp/scale``, ``mp/overflow``, ``mp/grad_norm``, ``mp/grad_underflow_frac``,
``mp/update_swamped_frac``, ``mp/overflow_module``...) logged through the loop's own loggers, with no host
sync on a step that is neither a logging step nor an overflow.  The rules here:

* :class:`FabricMonitor` (a Fabric callback) holds the step logic; :class:`MixedPrecisionMonitor` (a Trainer
  callback) maps the Trainer's hooks onto it;
* the meters (:func:`grad_norm`, :func:`underflow_counts`, :func:`swamped_counts`) evaluate the core's rules
  on the device on a strided sample (:func:`sample`);
* :class:`OverflowTracer` queues per-module "became non-finite" flags and names the first culprit on an
  overflow step (:func:`blame`);
* :func:`memory_report`: the bytes of model state actually held, next to the core's estimate.
"""

from .attribution import OverflowTracer, blame
from .memory import held_tensors, memory_report, optimizer_params, storage_dtypes
from .meters import (
    grad_norm,
    grad_underflow_fraction,
    sample,
    swamped_counts,
    underflow_counts,
    underflow_limit,
    update_swamped_fraction,
)
from .monitor import FabricMonitor
from .trainer_monitor import MixedPrecisionMonitor

__all__ = ["FabricMonitor", "MixedPrecisionMonitor", "OverflowTracer", "blame", "grad_norm",
           "grad_underflow_fraction", "held_tensors", "memory_report", "optimizer_params", "sample",
           "storage_dtypes", "swamped_counts", "underflow_counts", "underflow_limit", "update_swamped_fraction"]
