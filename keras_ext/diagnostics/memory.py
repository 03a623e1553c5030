"""What a Keras model and its :class:`~keras_ext.LossScaleOptimizer` hold, next to the core's estimate.

The Keras twin of the Lightning monitor's memory report: the bytes are counted from the variables that exist
(Keras keeps no gradients between steps, so they are counted as the step holds them: the variable's dtype, or
FP32 for a variable with a master, :attr:`~keras_ext.LossScaleOptimizer.fp32_master_grads`); the estimate and
the report's layout are the core's :func:`mp_callbacks.memory.memory_report`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import keras
import numpy as np

from mp_callbacks.dtypes import canonical_dtype, dtype_bytes
from mp_callbacks.fp8 import fp8_state_bytes
from mp_callbacks.memory import MemoryEstimate, is_optimizer_state
from mp_callbacks.memory import memory_report as core_memory_report

from ..fp8 import fp8_layers, fp8_recipe_of, is_fp8_variable
from ..weights import held_storage

__all__ = ["memory_report", "nbytes"]


def nbytes(v: Any) -> int:
    """Bytes of a variable's storage (float16/bfloat16/float32 by the core's table, others by NumPy)."""
    name = keras.backend.standardize_dtype(v.dtype)
    size = dtype_bytes(name) if name in ("float16", "bfloat16", "float32") else np.dtype(name).itemsize
    return int(np.prod(v.shape, dtype=np.int64)) * size


def memory_report(model: keras.Model, opt: Any) -> dict[str, Any]:
    """The core's memory report for ``opt.recipe`` with ``actual`` counted from the variables held.

    ``actual``: the trainable variables, the FP32 masters (``master_remainders``: their int16 remainders),
    the inner optimizer's variables that :func:`~mp_callbacks.memory.estimate.is_optimizer_state` counts,
    ``bf16-kahan``'s compensation buffers, the gradients, and under ``fp8-mixed`` the FP8 scaling variables
    (state, not parameters).
    """
    every = list(model.trainable_variables)
    masters = opt.master_variables if opt.master_weights and opt.built else [None] * len(every)
    fp8_vars = [v for v in every if is_fp8_variable(v)]
    masters = [m for m, v in zip(masters, every) if not is_fp8_variable(v)]
    tvs = [v for v in every if not is_fp8_variable(v)]
    numel = [int(np.prod(v.shape, dtype=np.int64)) for v in tvs]
    sizes = [nbytes(v) for v in tvs]
    inner = opt.inner_optimizer
    wide = opt.fp32_master_grads
    comps = opt.update_rounding.compensation_variables if opt.update_rounding is not None and opt.built else []
    actual = MemoryEstimate(
        params=sum(numel), weights=sum(sizes),
        grads=sum(n * 4 if m is not None and wide else b for n, b, m in zip(numel, sizes, masters)),
        masters=sum(nbytes(held_storage(m)) for m in masters if m is not None),
        optimizer_state=sum(nbytes(v) for v in inner.variables if is_optimizer_state(v.shape)),
        compensation=sum(nbytes(c) for c in comps if c is not None))
    storage = [(n, canonical_dtype(keras.backend.standardize_dtype(v.dtype))) for n, v in zip(numel, tvs)]
    momentum = float(getattr(inner, "momentum", 0.0) or 0.0)
    fp8_estimate = 0
    if fp8_vars:  # Keras gives the FP8 variables no optimizer slots
        actual = dataclasses.replace(actual, fp8_state=sum(nbytes(v) for v in fp8_vars))
        layers = list(fp8_layers(model))
        fp8_estimate = fp8_state_bytes(fp8_recipe_of(layers[0][1]), len(layers), "keras") if layers else 0
    return core_memory_report(opt.recipe.name, opt.recipe.master, [(type(inner).__name__, momentum, storage)],
                              actual, fp8_state=fp8_estimate, fp32_master_grads=wide)
