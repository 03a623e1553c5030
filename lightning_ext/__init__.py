"""lightning_ext: the mp_callbacks core as a PyTorch Lightning precision plugin.

``Trainer(plugins=[lightning_ext.MixedPrecision("bf16-master")])`` trains with
the core's recipes (``32-true``, ``16-mixed``, ``bf16-mixed``, ``16-master``,
``bf16-master``), its dynamic loss scaler (evaluated on the device through
:class:`TorchOps`), its operator policy and FP32 master weights;
``callbacks=[lightning_ext.MixedPrecisionMonitor()]`` logs the shared diagnostics.
"""

from .module_policy import apply_module_policy, cast_module_storage
from .monitor import MixedPrecisionMonitor, OverflowTracer
from .plugin import LossScalerView, MixedPrecision, check_strategy
from .torch_ops import TorchOps

__all__ = ["LossScalerView", "MixedPrecision", "MixedPrecisionMonitor", "OverflowTracer", "TorchOps",
           "apply_module_policy", "cast_module_storage", "check_strategy"]
