"""Update rounding without FP32 masters: the rules of ``bf16-kahan`` and ``bf16-sr``.

* :mod:`.rules`: Kahan compensation and stochastic rounding over a rounding-ops protocol, with
  the NumPy reference (:class:`NumpyRoundingOps`) and the rounding state record;
* :mod:`.random_source`: the counter-based random source of stochastic rounding and the
  canonical element layout (the same bits in every framework).
"""

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
from .rules import (
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
