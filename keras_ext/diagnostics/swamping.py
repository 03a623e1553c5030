"""What the Keras monitor's swamping meter (``mp/update_swamped_frac``) measures.

:func:`swamp_targets` names, for the snapshot before a logging step, each
variable the optimizer updates and the dtype its update is measured against
(:func:`~mp_callbacks.diagnostics.swamp_storage_dtype`): the FP32 master
under ``*-master``, else the variable; a variable counts as kept in FP32 when
its layer computes in float32 (by policy or fallback).  Under
``bf16-kahan``/``bf16-sr`` the rounded variables are metered on the FP32
update the update rounding keeps instead (:func:`swamp_counts`), as
Lightning meters them.
"""

from __future__ import annotations

from typing import Any

import keras
from keras import ops

from mp_callbacks.diagnostics import swamp_storage_dtype
from mp_callbacks.dtypes import canonical_dtype

from ..fp8 import is_fp8_variable
from ..layers import own_variables, walk
from ..optimizer import LossScaleOptimizer
from .meters import SwampMeter, swamped_counts

__all__ = ["swamp_counts", "swamp_targets"]


def swamp_targets(model: keras.Model, opt: LossScaleOptimizer) -> list[tuple[Any, str]]:
    """``(the variable the optimizer updates, the storage dtype its update is measured against)``."""
    kept: dict[int, bool] = {}
    for _, layer in walk(model):
        fp32 = canonical_dtype(layer.dtype_policy.compute_dtype) == "float32"
        for v in own_variables(layer):
            kept[id(v)] = fp32
    out = []
    rounding = opt.update_rounding
    for v in (v for v in model.trainable_variables if not is_fp8_variable(v)):
        if rounding is not None and rounding.working_variables[opt._get_variable_index(v)] is not None:
            continue  # bf16-kahan/bf16-sr: metered on the FP32 update the rounding keeps (swamp_counts)
        stored = canonical_dtype(keras.backend.standardize_dtype(v.dtype))
        master = opt.master_variables[opt._get_variable_index(v)] if opt.master_weights else None
        target = master if master is not None else v
        out.append((target, swamp_storage_dtype(opt.recipe, stored, kept.get(id(v), stored == "float32"))))
    return out


def swamp_counts(meter: SwampMeter, opt: LossScaleOptimizer, measure: bool) -> Any:
    """``[lost, nonzero]`` of the step: ``meter``'s snapshot targets, plus (``measure``) the FP32 updates
    the update rounding of ``bf16-kahan``/``bf16-sr`` tracked; None without either."""
    counts = meter.counts()
    rounding = opt.update_rounding
    tracked = rounding.tracked_updates() if rounding is not None and measure else []
    if tracked:
        extra = ops.stack(list(swamped_counts(*(list(x) for x in zip(*tracked)))))
        counts = extra if counts is None else ops.add(counts, extra)
    return counts
