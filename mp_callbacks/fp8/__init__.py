"""FP8 training: formats, the per-tensor scaling rule, settings and presets, what the recipe adds.

* :mod:`.formats`: ``float8_e4m3fn`` / ``float8_e5m2`` and the NumPy reference cast
  (:func:`fp8_round`, :func:`quantize_dequantize`, saturated / flushed fractions);
* :mod:`.config`: :class:`FP8ScalingConfig` (one tensor's settings) and :data:`FP8_PRESETS`
  (Transformer Engine, Keras, torchao);
* :mod:`.scaling`: the scaling transition (:func:`next_fp8_state`, delayed or current), its
  state and the :class:`FP8ArrayOps` extension of the array-ops protocol;
* :mod:`.granularity`: how finely tensors are scaled (:class:`FP8Granularity`: tensorwise,
  rowwise, blockwise, MXFP8) and the NumPy reference casts :func:`quantize` / :func:`dequantize`;
* :mod:`.allgather`: FP8 all-gather of sharded weights (the cast each rank makes, the amax reduction);
* :mod:`.recipe`: :class:`FP8Recipe`, what ``fp8-mixed`` adds to a recipe (which matmuls, the
  three tensors' configs, state bytes).

NVFP4 (4-bit E2M1 values, E4M3 scales per block of 16, an FP32 scale per tensor; the core's NumPy
reference, written over the :class:`NVFP4Ops` protocol for the adapters):

* :mod:`.fp4`: the E2M1 format, its rounding (nearest even, stochastic), codes and packing, and the
  :class:`NVFP4Ops` protocol;
* :mod:`.hadamard`: the random Hadamard transform of the weight-gradient operands;
* :mod:`.nvfp4`: the cast (:func:`nvfp4_quantize`; 1 x 16 and 16 x 16 blocks, Transformer Engine's and
  torchao's scale arithmetic), its dequantization and the saturated / flushed fractions;
* :mod:`.nvfp4_recipe`: :class:`NVFP4Recipe` (the recipe's settings), the roles of a Linear's six
  operands and the NumPy reference of its three matmuls (:func:`nvfp4_linear_reference`).
"""

from .allgather import FP8_GATHER_ROLE, gather_reduces_amax, sharded_fp8_cast
from .config import (
    AMAX_ALGOS,
    FP8_PRESETS,
    MODES,
    STORED,
    UPDATE_ORDERS,
    FP8ScalingConfig,
    preset_configs,
)
from .formats import (
    E4M3,
    E5M2,
    FLOAT32_MAX,
    FORMAT_ALIASES,
    FP8_FORMATS,
    HYBRID,
    TENSOR_ROLES,
    FP8ConfigError,
    FP8Format,
    flushed_fraction,
    fp8_format,
    fp8_round,
    quantize_dequantize,
    saturated_fraction,
)
from .fp4 import (
    E2M1_MAX,
    E2M1_VALUES,
    FP4_CODE_VALUES,
    NUMPY_NVFP4_OPS,
    THRESHOLD_UNIT,
    NumpyNVFP4Ops,
    NVFP4Ops,
    e4m3_bits,
    e4m3_from_bits,
    fp4_codes,
    fp4_round,
    fp4_values,
    pack_fp4,
    unpack_fp4,
)
from .granularity import (
    AMAX_EPSILON,
    E8M0_BIAS,
    E8M0_NAN,
    GRANULARITIES,
    MX_ROUNDINGS,
    FP8Granularity,
    block_shape,
    dequantize,
    matmul_snr_db,
    outlier_operands,
    quantize,
    scale_bytes,
)
from .hadamard import (
    RHT_SIZE,
    TE_SIGNS,
    hadamard_matrix,
    inverse_random_hadamard_transform,
    random_hadamard_transform,
    rht_signs,
)
from .nvfp4 import (
    E4M3_MIN_NORMAL,
    NVFP4_BLOCK,
    NVFP4_RULES,
    TENSOR_SCALE_DIVISOR,
    NVFP4Cast,
    nvfp4_block_scales,
    nvfp4_cast,
    nvfp4_dequantize,
    nvfp4_flushed_fraction,
    nvfp4_quantize,
    nvfp4_saturated_fraction,
)
from .nvfp4_recipe import (
    NVFP4_OPERANDS,
    SR_OPERANDS,
    NVFP4ConfigError,
    NVFP4Recipe,
    nvfp4_linear_reference,
    nvfp4_matmul_snr_db,
    nvfp4_operand,
    nvfp4_sr_key,
)
from .recipe import (
    FP8_LAYERS,
    FP8_ROLES,
    FP8Recipe,
    fp8_amax,
    fp8_linear_reference,
    fp8_qdq,
    fp8_state_bytes,
    fp8_transient_bytes,
)
from .scaling import (
    FP8_OP_NAMES,
    FP8_STATE_FIELDS,
    NUMPY_FP8_OPS,
    FP8ArrayOps,
    FP8State,
    NumpyFP8Ops,
    fp8_ops,
    fp8_state_from_dict,
    fp8_state_to_dict,
    initial_fp8_state,
    next_fp8_state,
    select_fp8_state,
)

__all__ = [
    "AMAX_EPSILON",
    "E8M0_BIAS",
    "E8M0_NAN",
    "FP8_GATHER_ROLE",
    "block_shape",
    "gather_reduces_amax",
    "matmul_snr_db",
    "outlier_operands",
    "scale_bytes",
    "sharded_fp8_cast",
    "FP8Granularity",
    "GRANULARITIES",
    "MX_ROUNDINGS",
    "dequantize",
    "quantize",
    "AMAX_ALGOS",
    "E4M3",
    "E5M2",
    "FLOAT32_MAX",
    "FORMAT_ALIASES",
    "FP8ArrayOps",
    "FP8ConfigError",
    "FP8Format",
    "FP8Recipe",
    "FP8ScalingConfig",
    "FP8State",
    "FP8_FORMATS",
    "FP8_LAYERS",
    "FP8_OP_NAMES",
    "FP8_PRESETS",
    "FP8_ROLES",
    "FP8_STATE_FIELDS",
    "HYBRID",
    "MODES",
    "NUMPY_FP8_OPS",
    "NumpyFP8Ops",
    "STORED",
    "TENSOR_ROLES",
    "UPDATE_ORDERS",
    "flushed_fraction",
    "fp8_amax",
    "fp8_format",
    "fp8_linear_reference",
    "fp8_ops",
    "fp8_qdq",
    "fp8_round",
    "fp8_state_bytes",
    "fp8_state_from_dict",
    "fp8_state_to_dict",
    "fp8_transient_bytes",
    "initial_fp8_state",
    "next_fp8_state",
    "preset_configs",
    "quantize_dequantize",
    "saturated_fraction",
    "select_fp8_state",
    # NVFP4
    "E2M1_MAX",
    "E2M1_VALUES",
    "E4M3_MIN_NORMAL",
    "FP4_CODE_VALUES",
    "NUMPY_NVFP4_OPS",
    "NVFP4_BLOCK",
    "NVFP4_OPERANDS",
    "NVFP4_RULES",
    "NVFP4Cast",
    "NVFP4ConfigError",
    "NVFP4Ops",
    "NVFP4Recipe",
    "NumpyNVFP4Ops",
    "RHT_SIZE",
    "SR_OPERANDS",
    "TENSOR_SCALE_DIVISOR",
    "TE_SIGNS",
    "THRESHOLD_UNIT",
    "e4m3_bits",
    "e4m3_from_bits",
    "fp4_codes",
    "fp4_round",
    "fp4_values",
    "hadamard_matrix",
    "inverse_random_hadamard_transform",
    "nvfp4_block_scales",
    "nvfp4_cast",
    "nvfp4_dequantize",
    "nvfp4_flushed_fraction",
    "nvfp4_linear_reference",
    "nvfp4_matmul_snr_db",
    "nvfp4_operand",
    "nvfp4_quantize",
    "nvfp4_saturated_fraction",
    "nvfp4_sr_key",
    "pack_fp4",
    "random_hadamard_transform",
    "rht_signs",
    "unpack_fp4",
]
