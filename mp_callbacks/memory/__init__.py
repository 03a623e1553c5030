"""Memory accounting: what each recipe's training state costs, on one device and sharded.

* :mod:`.estimate`: bytes per parameter (:func:`estimate_memory`, :func:`bytes_per_param`,
  :func:`memory_report`) from a recipe's :class:`~mp_callbacks.weights.masters.MasterPlan`;
* :mod:`.low_bit`: the block-quantized states of low-bit optimizers (torchao's AdamW8bit/4bit/Fp8);
* :mod:`.nvfp4`: bytes of NVFP4 copies of tensors (4-bit codes, E4M3 block scales, FP32 tensor scale);
* :mod:`.sharding`: a recipe across ranks (FSDP dtypes, all-reduce and FSDP payloads, the
  overflow consensus).
"""

from .estimate import (
    OPTIMIZER_SLOTS,
    MemoryEstimate,
    bytes_per_param,
    estimate_memory,
    is_optimizer_state,
    memory_report,
    optimizer_kind,
    optimizer_slots,
)
from .low_bit import EIGHT_BIT, LOW_BIT_STATES, LowBitStates
from .nvfp4 import nvfp4_tensor_bytes, nvfp4_transient_bytes
from .sharding import (
    ShardedDtypes,
    allreduce_bytes,
    consensus_cost,
    fsdp_step_bytes,
    padded_numel,
    sharded_dtypes,
)

__all__ = [
    "EIGHT_BIT",
    "LOW_BIT_STATES",
    "LowBitStates",
    "MemoryEstimate",
    "OPTIMIZER_SLOTS",
    "ShardedDtypes",
    "allreduce_bytes",
    "bytes_per_param",
    "consensus_cost",
    "estimate_memory",
    "fsdp_step_bytes",
    "is_optimizer_state",
    "memory_report",
    "nvfp4_tensor_bytes",
    "nvfp4_transient_bytes",
    "optimizer_kind",
    "optimizer_slots",
    "padded_numel",
    "sharded_dtypes",
]
