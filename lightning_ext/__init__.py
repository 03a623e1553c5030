"""lightning_ext: the mp_callbacks core as a PyTorch Lightning precision plugin.

``Trainer(plugins=[lightning_ext.MixedPrecision("bf16-master")])`` trains with
the core's recipes, its dynamic loss scaler (:class:`TorchLossScaler`, torch
``GradScaler``'s API, evaluated on the device through :class:`TorchOps`), its
operator policy, FP32 master weights (:class:`MasterWeights`) and, for
``bf16-kahan``/``bf16-sr``, update rounding around the user's optimizer (:class:`UpdateRounding`);
``callbacks=[lightning_ext.MixedPrecisionMonitor()]`` logs the shared diagnostics.

Modules, one job each: ``plugin`` (Lightning hooks), ``torch_scaler``,
``masters``, ``update_rounding`` (with ``rounding_ops``: the core's rounding ops in torch),
``scheduler_hold``, ``support``, ``module_policy``, ``attribution``, ``monitor``, ``memory``
(bytes held next to the core's estimate), ``torch_meters``, ``torch_ops``, ``compare``; scaling out:
``fsdp`` (ModelParallelStrategy / FSDP2), ``fsdp1`` (:class:`FSDPMixedPrecision` for FSDPStrategy),
``comm`` (the recipe's ``comm_dtype`` as a DDP communication hook, :class:`CommCounter`).
"""

from .attribution import OverflowTracer
from .distributed import CommCounter
from .fsdp import fully_shard_model
from .fsdp1 import FSDPMixedPrecision
from .masters import MasterWeights
from .monitor import MixedPrecisionMonitor
from .ops import TorchOps
from .plugin import MixedPrecision
from .policy import apply_module_policy, cast_module_storage
from .rounding import UpdateRounding
from .rounding_ops import TorchRoundingOps
from .scaler import OptState, TorchLossScaler
from .support import check_strategy

__all__ = ["CommCounter", "FSDPMixedPrecision", "MasterWeights", "MixedPrecision", "MixedPrecisionMonitor", "OptState", "OverflowTracer",
           "TorchLossScaler", "TorchOps", "TorchRoundingOps", "UpdateRounding", "apply_module_policy",
           "cast_module_storage", "check_strategy", "fully_shard_model"]
