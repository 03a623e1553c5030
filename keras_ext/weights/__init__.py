"""What keeps an optimizer's weights right when they are stored below FP32: masters, remainders, update
rounding, 8-bit states.

The rules are the core's (:mod:`mp_callbacks.weights`); :class:`keras_ext.LossScaleOptimizer` drives one store
(:func:`weight_store`) through the same interface (``build``, ``targets``, ``write_back``, ``variables``):

* :class:`MasterWeights`: an FP32 master per float16/bfloat16 variable, as an optimizer variable; the inner
  optimizer updates the masters (FP32 slots) and each applied step rounds them back (``*-master``);
* :class:`RemainderMasters`: each FP32 master held exactly as its bf16 variable plus an int16 remainder
  (``master_remainders``), the FP32-copy masters bit for bit;
* :class:`UpdateRounding`: ``bf16-kahan`` / ``bf16-sr``: the inner optimizer updates an FP32 working value and the
  core's Kahan or stochastic-rounding rule writes it into the bf16 variable (:mod:`.rounding_ops`: the rules
  over ``keras.ops``, compiled per variable);
* :class:`AdamW8bit`: Adam's moments block-quantized to 8 bits (``state_dtype="8bit"``, :func:`eight_bit_inner`).

Everything a store holds is an optimizer variable, so ``model.save`` / ``save_weights`` / ``load_model`` carry it.
A skipped step writes none of it.
"""

from .low_bit import KERAS_QUANT_OPS, AdamW8bit, KerasQuantOps, eight_bit_inner
from .masters import FP32_SOURCE, LOW_PRECISION, MasterWeights
from .remainders import RemainderMaster, RemainderMasters, fp32_record, held_storage, join, split
from .rounding import UpdateRounding, WorkingVariable
from .rounding_ops import (
    FUSED,
    KERAS_ROUNDING_OPS,
    KERNEL_NAMES,
    KerasRoundingOps,
    canonical_perm,
    compensated,
    element_index,
    kahan,
    stochastic,
)
from .store import check_variables, weight_store

__all__ = [
    "FP32_SOURCE",
    "FUSED",
    "KERAS_QUANT_OPS",
    "KERAS_ROUNDING_OPS",
    "KERNEL_NAMES",
    "LOW_PRECISION",
    "AdamW8bit",
    "KerasQuantOps",
    "KerasRoundingOps",
    "MasterWeights",
    "RemainderMaster",
    "RemainderMasters",
    "UpdateRounding",
    "WorkingVariable",
    "canonical_perm",
    "check_variables",
    "compensated",
    "eight_bit_inner",
    "element_index",
    "fp32_record",
    "held_storage",
    "join",
    "kahan",
    "split",
    "stochastic",
    "weight_store",
]
