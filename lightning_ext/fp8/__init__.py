"""``fp8-mixed`` in torch: FP8 matmuls, their scaling states, block casts, attention, FP8 all-gather.

The concept (the core's :mod:`mp_callbacks.fp8`): the inputs of a low-precision matmul are quantized to FP8
(e4m3 forward, e5m2 for the output gradient) with a scale per tensor, row, block or MX block; the scales
follow the core's rule from each tensor's amax (delayed or current scaling).  The rules here:

* :class:`TorchFP8` replaces the ``forward`` of every ``nn.Linear`` and ``nn.MultiheadAttention`` the policy
  runs in low precision (:func:`fp8_modules`) by an FP8 matmul, keeps the states as batched device tensors,
  folds a non-finite amax into the step's ``found_inf`` (such a step is skipped) and steps the states after
  an applied step with no host read;
* under FSDP2 with ``fp8={"fsdp_float8_all_gather": True}`` the Linear weights are all-gathered in FP8
  (:class:`FP8AllGatherWeight`, FSDP2's all-gather extension).
"""

from .allgather import FP8AllGatherWeight
from .layers import TorchFP8, fp8_modules

__all__ = ["FP8AllGatherWeight", "TorchFP8", "fp8_modules"]
