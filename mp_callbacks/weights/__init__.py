"""Weights: how a recipe stores weights and updates them.

* :mod:`.masters`: :class:`MasterPlan`, which parameters get FP32 master copies and what a recipe holds per
  parameter (weights, masters, optimizer states);
* :mod:`.remainders`: an FP32 master held exactly as its bf16 weight plus a 16-bit remainder
  (:func:`split_master` / :func:`join_master`, the NumPy reference);
* :mod:`.rounding`: update rounding without masters, Kahan compensation and stochastic rounding
  (``bf16-kahan``, ``bf16-sr``), over the :class:`RoundingOps` protocol;
* :mod:`.random_source`: the counter-based random source of stochastic rounding and the canonical
  element layout (the same bits in every framework);
* :mod:`.low_bit`: 8-bit block-quantized optimizer states (``state_dtype="8bit"``), torchao's layout.
"""

from .low_bit import (
    BLOCK_SIZE,
    CODES,
    MIN_NUMEL,
    NUMPY_QUANT_OPS,
    SCALE_FLOOR,
    STATE_8BIT,
    NumpyQuantOps,
    QuantOps,
    adam_step_8bit,
    dequantize_8bit,
    dynamic_map,
    lerp_8bit,
    quantize_8bit,
    quantizes,
)
from .masters import STATE_DTYPES, MasterPlan, check_state_dtype
from .random_source import (
    MASK32,
    MIX_MUL1,
    MIX_MUL2,
    PY_INT_OPS,
    PyIntOps,
    index_strides,
    keras_kernel_to_canonical,
    layout_index,
    mix32,
    s32,
    sr_key,
    sr_thresholds,
)
from .remainders import forward_half, join_master, split_master, ties_differ, upper_half
from .rounding import (
    BF16_NAN_BITS,
    NUMPY_ROUNDING_OPS,
    ROUNDING_MODES,
    ROUNDING_SCHEMA_VERSION,
    NumpyRoundingOps,
    RoundingOps,
    RoundingStream,
    bf16_bits,
    bf16_to_f32,
    check_mode,
    compensated_value,
    initial_compensation,
    kahan_add,
    kahan_apply,
    make_rounding_state,
    read_rounding_state,
    round_with_thresholds,
    stochastic_round,
)

__all__ = [
    "BLOCK_SIZE",
    "CODES",
    "MIN_NUMEL",
    "MasterPlan",
    "NUMPY_QUANT_OPS",
    "NumpyQuantOps",
    "QuantOps",
    "SCALE_FLOOR",
    "STATE_8BIT",
    "STATE_DTYPES",
    "adam_step_8bit",
    "check_state_dtype",
    "dequantize_8bit",
    "dynamic_map",
    "forward_half",
    "join_master",
    "lerp_8bit",
    "quantize_8bit",
    "quantizes",
    "split_master",
    "ties_differ",
    "upper_half",
    "BF16_NAN_BITS",
    "MASK32",
    "MIX_MUL1",
    "MIX_MUL2",
    "NUMPY_ROUNDING_OPS",
    "NumpyRoundingOps",
    "PY_INT_OPS",
    "PyIntOps",
    "ROUNDING_MODES",
    "ROUNDING_SCHEMA_VERSION",
    "RoundingOps",
    "RoundingStream",
    "bf16_bits",
    "bf16_to_f32",
    "check_mode",
    "compensated_value",
    "index_strides",
    "initial_compensation",
    "kahan_add",
    "kahan_apply",
    "keras_kernel_to_canonical",
    "layout_index",
    "make_rounding_state",
    "mix32",
    "read_rounding_state",
    "round_with_thresholds",
    "s32",
    "sr_key",
    "sr_thresholds",
    "stochastic_round",
]
