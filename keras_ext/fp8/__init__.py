"""``fp8-mixed`` in Keras: FP8 ``Dense`` / ``EinsumDense`` matmuls with the core's scaling.

The arithmetic and the scaling rule are the core's (:mod:`mp_callbacks.fp8`): e4m3 inputs and weights forward,
e5m2 output gradients backward, delayed or current scaling per tensor, or a finer granularity (rowwise,
blockwise 1x128/128x128, MXFP8 1x32 with E8M0 scales: :mod:`.blocks`).  :func:`install` gives every
low-precision ``Dense``/``EinsumDense`` of a model an FP8 call and its FP8 state variables (what
:func:`keras_ext.apply_policy` does under ``fp8-mixed``); the state moves only on applied steps (it is the
optimizer's to write), a non-finite amax skips the step like any overflow, and :class:`FP8Policy` carries the
settings through ``.keras`` files (:func:`keras_ext.load_model` restores the calls: :func:`restore`).
"""

from .blocks import block_matmul, block_qdq, contracted_axes
from .dense import (
    FP8_VARIABLE_FIELDS,
    FP8Policy,
    enable_fp8,
    fp8_layers,
    fp8_recipe_of,
    fp8_state,
    host_metrics,
    install,
    is_fp8_variable,
    restore,
)

__all__ = [
    "FP8_VARIABLE_FIELDS",
    "FP8Policy",
    "block_matmul",
    "block_qdq",
    "contracted_axes",
    "enable_fp8",
    "fp8_layers",
    "fp8_recipe_of",
    "fp8_state",
    "host_metrics",
    "install",
    "is_fp8_variable",
    "restore",
]
