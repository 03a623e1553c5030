"""lightning_ext: the mp_callbacks core as a PyTorch Lightning precision plugin, for the Trainer and Fabric.

``Trainer(plugins=[lightning_ext.MixedPrecision("bf16-master")])`` and
``Fabric(plugins=[lightning_ext.FabricMixedPrecision("bf16-master")])`` train with the core's recipes,
its dynamic loss scaler (:class:`TorchLossScaler`, torch ``GradScaler``'s API, evaluated on the device
through :class:`TorchOps`), its operator policy and one weight store (FP32 master weights,
:class:`MasterWeights`, or, for ``bf16-kahan``/``bf16-sr``, update rounding around the user's optimizer,
:class:`UpdateRounding`); ``callbacks=[lightning_ext.MixedPrecisionMonitor()]`` (Trainer) or
``[lightning_ext.FabricMonitor()]`` (Fabric) logs the shared diagnostics.

Layout, by the core's concepts: :mod:`lightning_ext.fabric` (the Fabric precision plugin, holding the logic;
its set-up in :mod:`lightning_ext.setup`), :mod:`lightning_ext.trainer` (the Trainer plugin, a thin
subclass), :mod:`lightning_ext.ops` (the core's array ops over torch) and the subpackages
:mod:`~lightning_ext.loss_scale`, :mod:`~lightning_ext.weights`, :mod:`~lightning_ext.fp8`,
:mod:`~lightning_ext.policy`, :mod:`~lightning_ext.diagnostics`, :mod:`~lightning_ext.distributed`,
:mod:`~lightning_ext.checkpoint`, each introduced by its ``__init__``.
"""

from .checkpoint import CheckedCheckpointIO, CheckpointFileError
from .diagnostics import FabricMonitor, MixedPrecisionMonitor, OverflowTracer
from .distributed import CommCounter, FSDPMixedPrecision, fully_shard_model
from .fabric import MixedPrecision as FabricMixedPrecision
from .loss_scale import OptState, TorchLossScaler
from .ops import TorchOps
from .policy import apply_module_policy, cast_module_storage
from .support import check_strategy
from .trainer import MixedPrecision
from .weights import MasterWeights, TorchRoundingOps, UpdateRounding, weight_store

__all__ = ["CheckedCheckpointIO", "CheckpointFileError", "CommCounter", "FSDPMixedPrecision", "FabricMixedPrecision",
           "FabricMonitor", "MasterWeights", "MixedPrecision", "MixedPrecisionMonitor", "OptState", "OverflowTracer",
           "TorchLossScaler", "TorchOps", "TorchRoundingOps", "UpdateRounding", "apply_module_policy",
           "cast_module_storage", "check_strategy", "fully_shard_model", "weight_store"]
