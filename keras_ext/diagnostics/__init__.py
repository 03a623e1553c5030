"""The core's diagnostics in Keras: the monitor callback, its device record, the meters, overflow attribution,
the memory held, the swamping meter's targets, the auto-fallback.

The names, cadence, history and guards are the core's (:mod:`mp_callbacks.diagnostics`, :mod:`mp_callbacks.memory`);
here the numbers are gathered inside the traced step with ``keras.ops`` and read on the host in one read per
logging step:

* :class:`MixedPrecisionMonitor`: a ``keras.callbacks.Callback`` writing the shared ``mp/*`` names into Keras' logs;
* :class:`DeviceRecord`: what the step writes for that read (the step's scale and flag, the meters when asked,
  one row per overflow step);
* the meters (:func:`grad_norm`, :func:`underflow_counts`, :func:`swamped_counts`, :class:`SwampMeter`): the
  core's rules on a strided sample, no host read;
* :class:`LayerAttribution`: which layer made a step's gradients non-finite, in the same step;
* :func:`memory_report`: what the model and optimizer hold, next to the core's estimate;
* :func:`move_layer_to_fp32`: the auto-fallback's move of one layer to FP32 compute.
"""

from .attribution import LayerAttribution
from .fallback import blocked_message, move_layer_to_fp32
from .memory import memory_report, nbytes
from .meters import (
    SwampMeter,
    grad_norm,
    grad_underflow_fraction,
    swamped_counts,
    underflow_counts,
    update_swamped_fraction,
)
from .monitor import MONITOR_SCHEMA, MONITOR_SCHEMA_VERSION, MixedPrecisionMonitor
from .record import COUNTERS, DeviceRecord
from .swamping import swamp_counts, swamp_targets

__all__ = [
    "COUNTERS",
    "MONITOR_SCHEMA",
    "MONITOR_SCHEMA_VERSION",
    "DeviceRecord",
    "LayerAttribution",
    "MixedPrecisionMonitor",
    "SwampMeter",
    "blocked_message",
    "grad_norm",
    "grad_underflow_fraction",
    "memory_report",
    "move_layer_to_fp32",
    "nbytes",
    "swamp_counts",
    "swamp_targets",
    "swamped_counts",
    "underflow_counts",
    "update_swamped_fraction",
]
