"""lightning_ext: the mp_callbacks core as a PyTorch Lightning precision plugin, for the Trainer and Fabric.

``Trainer(plugins=[lightning_ext.MixedPrecision("bf16-master")])`` and
``Fabric(plugins=[lightning_ext.FabricMixedPrecision("bf16-master")])`` train with
the core's recipes, its dynamic loss scaler (:class:`TorchLossScaler`, torch
``GradScaler``'s API, evaluated on the device through :class:`TorchOps`), its
operator policy, one weight store (FP32 master weights, :class:`MasterWeights`, or, for
``bf16-kahan``/``bf16-sr``, update rounding around the user's optimizer, :class:`UpdateRounding`);
``callbacks=[lightning_ext.MixedPrecisionMonitor()]`` (Trainer) or ``[lightning_ext.FabricMonitor()]``
(Fabric) logs the shared diagnostics.

Modules, one job each: ``fabric`` (the precision plugin's logic, Fabric's hooks), ``plugin`` (the
Trainer's hooks, a thin subclass), ``scaler``, ``divergence``, ``masters``, ``rounding`` (with
``rounding_ops``: the core's rounding ops in torch), ``scheduler_hold``, ``support``, ``policy``,
``checkpoint``, ``attribution``, ``fabric_monitor`` and ``monitor`` (the diagnostics as a Fabric and a
Trainer callback), ``memory`` (bytes held next to the core's estimate), ``meters``, ``ops``, ``fp8``;
scaling out: ``fsdp`` (ModelParallelStrategy / FSDP2), ``fsdp1`` (:class:`FSDPMixedPrecision` for
FSDPStrategy), ``distributed`` (the recipe's ``comm_dtype`` as a DDP communication hook, :class:`CommCounter`).
"""

from .attribution import OverflowTracer
from .checkpoint import CheckedCheckpointIO, CheckpointFileError
from .distributed import CommCounter
from .fabric import MixedPrecision as FabricMixedPrecision
from .fabric_monitor import FabricMonitor
from .fsdp import fully_shard_model
from .fsdp1 import FSDPMixedPrecision
from .masters import MasterWeights
from .monitor import MixedPrecisionMonitor
from .ops import TorchOps
from .plugin import MixedPrecision
from .policy import apply_module_policy, cast_module_storage
from .rounding import UpdateRounding, weight_store
from .rounding_ops import TorchRoundingOps
from .scaler import OptState, TorchLossScaler
from .support import check_strategy

__all__ = ["CheckedCheckpointIO", "CheckpointFileError", "CommCounter", "FSDPMixedPrecision", "FabricMixedPrecision",
           "FabricMonitor", "MasterWeights", "MixedPrecision", "MixedPrecisionMonitor", "OptState", "OverflowTracer",
           "TorchLossScaler", "TorchOps", "TorchRoundingOps", "UpdateRounding", "apply_module_policy",
           "cast_module_storage", "check_strategy", "fully_shard_model", "weight_store"]
