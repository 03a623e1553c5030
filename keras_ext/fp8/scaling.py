"""The FP8 quantize-dequantize of one tensor with the core's scaling, its state carried in layer variables.

Each tensor role (``inputs``, ``weights``, ``grad_outputs``) of an FP8 layer has float32 variables
(:data:`FP8_VARIABLE_FIELDS`) with ``overwrite_with_gradient=True``: their "gradients" are the next state
(:func:`mp_callbacks.fp8.next_fp8_state` evaluated with :class:`~keras_ext.ops.KerasOps`), so the optimizer writes
them, and only on applied steps.  :func:`forward_qdq` quantize-dequantizes an input or a weight (e4m3) forward;
:func:`backward_qdq` is the identity forward and quantize-dequantizes the output gradient (e5m2) backward.  The
``nonfinite`` variable's "gradient" is NaN when the role's amax was not finite, so the optimizer's finite check
skips the step.  Delayed scaling quantizes with the committed state, current scaling with the new one.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from keras import ops

from mp_callbacks.fp8 import FP8State, next_fp8_state

from ..ops import KERAS_OPS, is_tf

__all__ = ["FP8_VARIABLE_FIELDS", "backward_qdq", "forward_qdq"]

FP8_VARIABLE_FIELDS = ("amax_history", "scale", "scale_inv", "nonfinite", "stats")
"""The variables of one tensor role, ``fp8_<role>_<field>``: the state, the non-finite flag, and the
last applied step's ``stats`` (amax, saturated, flushed, elements) that the monitor reads."""


def _amax(x: Any) -> Any:
    """max |x| as float32; NaN when any element is NaN (whatever the backend's max does with NaN)."""
    x = ops.cast(x, "float32")
    amax = ops.max(ops.abs(x))
    return ops.where(ops.any(ops.isnan(x)), ops.convert_to_tensor(np.float32(np.nan)), amax)


def _qdq(x32: Any, config: Any, scale: Any, scale_inv: Any, amax: Any = None) -> Any:
    """The float32 value after the FP8 round trip (the core's :func:`~mp_callbacks.fp8.recipe.fp8_qdq`);
    with ``amax``, also the stats vector ``[amax, saturated, flushed, elements]``."""
    fmax = float(config.fmt.max)
    y = ops.divide(x32, scale_inv) if config.stored == "scale_inv" else ops.multiply(x32, scale)
    q = ops.cast(ops.cast(ops.clip(y, -fmax, fmax), config.format), "float32")
    out = ops.multiply(q, scale_inv)
    if amax is None:
        return out
    saturated = ops.sum(ops.cast(ops.greater(ops.abs(y), fmax), "float32"))
    flushed = ops.sum(ops.cast(ops.logical_and(ops.not_equal(x32, 0.0), ops.equal(q, 0.0)), "float32"))
    size = ops.cast(ops.size(x32), "float32")
    return out, ops.stack([ops.cast(amax, "float32"), saturated, flushed, size])


def _read(variable: Any) -> Any:
    """The variable's value as a tensor read outside the custom-gradient function (eager TensorFlow
    would otherwise see the variable used inside it and ask for variable gradients)."""
    value = ops.convert_to_tensor(variable)
    if is_tf():
        import tensorflow as tf

        value = tf.convert_to_tensor(value)
    return value


def _state_of(values: list[Any]) -> FP8State:
    zero = ops.convert_to_tensor(0, dtype="int32")
    return FP8State(values[0], values[1], values[2], zero, zero)


def _step(config: Any, values: list[Any], x: Any) -> tuple[FP8State, FP8State, Any, Any]:
    """``(state to quantize with, state to write, nonfinite flag value, amax)`` for the tensor ``x``."""
    state = _state_of(values)
    amax = _amax(x)
    new, ok = next_fp8_state(config, state, amax, KERAS_OPS)
    flag = ops.where(ok, ops.convert_to_tensor(np.float32(0)), ops.convert_to_tensor(np.float32(np.nan)))
    return (new if config.mode == "current" else state), new, flag, amax


def forward_qdq(config: Any, x32: Any, variables: dict[str, Any], training: bool, cast: Any = None) -> Any:
    """qdq of an input or weight; while training, the next state is the variables' "gradient".

    ``cast``: a finer granularity's cast (``x -> (qdq(x), stats)``): the value passes unchanged (the matmul
    casts it, :mod:`keras_ext.fp8.blocks`) and the cast gives the stats; the state keeps the tensor's amax."""
    values = [_read(variables[f]) for f in FP8_VARIABLE_FIELDS]
    if not training and cast is not None:
        return x32
    if not training:
        if config.mode == "current":
            use = _step(config, values, x32)[0]
        else:
            use = _state_of(values)
        return _qdq(x32, config, use.scale, use.scale_inv)

    @ops.custom_gradient
    def qdq(x, history, scale, scale_inv, nonfinite, stats):
        use, new, flag, amax = _step(config, [history, scale, scale_inv], x)
        if cast is None:
            out, seen = _qdq(x, config, use.scale, use.scale_inv, amax)
        else:
            out, seen = x, cast(x)[1]

        def grad(*args: Any, upstream: Any = None, variables: Any = None) -> Any:
            if upstream is None:
                (upstream,) = args
            return upstream, new.amax_history, new.scale, new.scale_inv, flag, seen

        return out, grad

    return qdq(x32, *values)


def backward_qdq(config: Any, y32: Any, variables: dict[str, Any], cast: Any = None) -> Any:
    """Identity forward; the output gradient quantize-dequantizes (e5m2) in the backward (``cast``: a finer
    granularity's, whose matmul casts the gradient itself: here it passes unchanged, for the state and stats)."""
    values = [_read(variables[f]) for f in FP8_VARIABLE_FIELDS]

    @ops.custom_gradient
    def qdq(y, history, scale, scale_inv, nonfinite, stats):
        def grad(*args: Any, upstream: Any = None, variables: Any = None) -> Any:
            if upstream is None:
                (upstream,) = args
            g32 = ops.cast(upstream, "float32")
            use, new, flag, amax = _step(config, [history, scale, scale_inv], g32)
            if cast is None:
                out, seen = _qdq(g32, config, use.scale, use.scale_inv, amax)
            else:
                out, seen = g32, cast(g32)[1]
            return ops.cast(out, upstream.dtype), new.amax_history, new.scale, new.scale_inv, flag, seen

        return y, grad

    return qdq(y32, *values)
