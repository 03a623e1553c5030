"""What keeps the optimizer's weights right: FP32 masters, update rounding, 8-bit optimizer states.

The concept (the core's :mod:`mp_callbacks.weights`): low-precision weights lose small updates (swamping);
a recipe keeps them by one of two weight stores (:func:`weight_store`), both around the user's optimizer:

* :class:`MasterWeights` (``*-master``, ``fp8-mixed``): an FP32 master per low-precision parameter, in the
  optimizer's param groups in its place; the gradients move onto the masters before the check, the user's
  optimizer steps the masters as torch wrote it, and the weights are rebuilt from them (optionally each
  master held as its bf16 weight plus a 16-bit remainder between steps: ``master_remainders``).  For speed,
  pass ``fused=True`` (or ``foreach=True``) to your ``AdamW``: that is your optimizer's choice, honoured as
  given.
* :class:`UpdateRounding` (``bf16-kahan``, ``bf16-sr``): bf16 weights updated by the core's Kahan or
  stochastic-rounding rule from an FP32 update, computed chunk by chunk (:class:`TorchRoundingOps`: the core's
  rounding ops in torch).
* :class:`EightBitAdamW` (``state_dtype="8bit"``): torchao's ``AdamW8bit`` computes the step of the user's
  ``AdamW`` (its groups and state), the user's optimizer object kept.

A skipped step never calls a store's ``step``: weights, masters, compensation, the rounding stream and the
optimizer state stay as they were.
"""

from .low_bit import EightBitAdamW
from .masters import MasterEntry, MasterWeights
from .rounding import RoundingEntry, UpdateRounding
from .rounding_ops import TorchRoundingOps
from .store import weight_store

__all__ = ["EightBitAdamW", "MasterEntry", "MasterWeights", "RoundingEntry", "TorchRoundingOps", "UpdateRounding",
           "weight_store"]
