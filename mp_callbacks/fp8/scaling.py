"""Per-tensor FP8 scaling: the one transition, its state and its array-ops extension.

The FP8 code of the core is split by job; every public name is importable
from here:

* :mod:`mp_callbacks.fp8.formats`: the formats (e4m3fn, e5m2) and the NumPy
  reference of the cast (:func:`fp8_round`, :func:`quantize_dequantize`,
  saturated / flushed fractions);
* :mod:`mp_callbacks.fp8.config`: :class:`FP8ScalingConfig` and the anchors'
  presets;
* this module: the rule below (:func:`next_fp8_state`), the state, the
  :class:`FP8ArrayOps` extension of the array-ops protocol with its NumPy
  backend, and the state's plain-data form.

FP8 keeps a tensor ``x`` as ``q = fp8(x * scale)`` and reads it back as
``q * scale_inv`` (``scale_inv = 1 / scale``).  Each tensor (the inputs and the
weights of a matmul in the forward pass, the output gradient in the backward
pass) has its own scale, chosen so that the tensor's absolute maximum (amax)
lands just inside the format's range.  The HYBRID recipe of every anchor uses
``float8_e4m3fn`` (more mantissa) forward and ``float8_e5m2`` (more range)
backward.

The rule (every preset is a setting of it), for one tensor and one step, given
``amax`` = max |x| of this step's tensor (already reduced over data-parallel
ranks)::

    if amax is inf or NaN:            the step is skipped: history, scale and
                                      scale_inv stay as they were, ok = False
    else:                             ok = True
        record amax in the history (length history_len, layout below)
        window = amax                              mode "current"
               = amax                              "delayed", amax_algo "most_recent"
               = max(history incl. this amax)      "delayed", "max", update_order "record_first"
               = max(history before this amax)     "delayed", "max", update_order "scale_first"
        if amax_epsilon > 0 and window < amax_epsilon:
            scale = fp8_max * 2**-margin / amax_epsilon   (computed in float64, rounded to float32)
        elif window is finite and window > 0 (or amax_epsilon > 0):
            scale = (fp8_max * 2**-margin) / window       (float32 division)
        else:                                      (window == 0: nothing seen yet)
            scale = the previous scale
        if clamp_inf_scale and scale is inf:       (window so tiny that the division overflows)
            scale = float32 max
        scale_inv = 1 / scale                      (float32)

"The previous scale" is ``state.scale`` when the anchor stores the scale
(``stored="scale"``, Transformer Engine) and ``1 / state.scale_inv`` when it
stores only the inverse (``stored="scale_inv"``, Keras, whose variable named
``scale`` is our ``scale_inv``: Keras quantizes ``x / scale_keras`` and
dequantizes ``q * scale_keras``; the reciprocal of a reciprocal is not always
the same float32, so the difference shows in the last bit).

History layouts, both "roll left by one, then overwrite slot 0" as the anchors
write them (``h = [h0, h1, ..., h(L-1)]``)::

    record_first (Transformer Engine): this step's amax is written into slot 0,
        the window is taken over all L slots, then the history is rolled left
        and slot 0 zeroed:  [0, h2, ..., h(L-1), amax]
        (slot 0 is the "current" slot and is 0 between steps; slots 1..L-1
        hold the previous L-1 amaxes, oldest first; the window covers this
        amax and the L-1 before it).
    scale_first (Keras): the window is taken over the history as it was
        (the previous L amaxes: this step's scale change lags one more step),
        then the history is rolled left and this amax written into slot 0:
        [amax, h2, ..., h(L-1), h0]
        (slot 0 is the newest, slots 1..L-1 the older ones, oldest first).

How this differs from the anchors, on purpose and only there:

* A non-finite amax never enters the history.  Both anchors record it
  (Transformer Engine keeps its previous scale while an inf sits in the
  window, up to ``history_len`` steps; Keras's max over the history turns
  NaN and freezes the same way).  Here the tensor's step is skipped like any
  overflow and the history stays clean; an anchor whose update is not run on
  that step (Keras under ``LossScaleOptimizer``, which skips the step and with
  it the float8 variables) behaves exactly like this rule.
* The ``keras`` preset clamps an overflowing scale to float32 max
  (``clamp_inf_scale=True``, as Transformer Engine does); Keras itself lets it
  become inf and stores ``scale_inv = 0``, which turns the next quantization
  into NaN.  Set ``clamp_inf_scale=False`` for Keras's behaviour.
* The ``torchao`` preset keeps the previous scale on a non-finite amax
  (torchao's own ``fp8_max / clamp(amax, 1e-12)`` is 0 for inf and NaN for
  NaN); identical otherwise.
* ``margin`` is applied as Transformer Engine's kernel does
  (``fp8_max * 2**-margin`` first, then the division); Keras and TE-JAX divide
  by ``2**margin`` after, which differs only when ``fp8_max / window``
  overflows float32 (Keras's layers always use margin 0).

The transition (:func:`next_fp8_state`) is pure and branch-free over the
array-ops protocol (:mod:`mp_callbacks.ops`) plus five vector ops
(:class:`FP8ArrayOps`: ``divide``, ``reduce_max``, ``roll_left``,
``set_first``, ``zeros``), implemented here for NumPy.  How a training step
uses it:

* delayed: quantize this step's tensor with ``state.scale`` (and dequantize
  with ``state.scale_inv``), measure its amax, then
  ``state, ok = next_fp8_state(config, state, amax)``;
* current: measure the amax first, step the state, then quantize with the new
  ``state.scale``.

``ok`` is False when the amax was not finite: the adapter ORs ``not ok`` into
the step's ``found_inf`` so that the loss scaler skips the step.  To skip the
float8 updates of every tensor on a skipped step (what Keras does under its
``LossScaleOptimizer``), keep the old states with :func:`select_fp8_state`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple, Protocol, runtime_checkable

import numpy as np

from ..ops import Array, ArrayOps, NumpyOps
from ..settings import is_int, is_number
from .config import FP8ScalingConfig
from .formats import (
    FLOAT32_MAX,
)

# -- the protocol extension ------------------------------------------------------------


FP8_OP_NAMES = ("divide", "reduce_max", "roll_left", "set_first", "zeros")
"""The methods :class:`FP8ArrayOps` adds to :class:`mp_callbacks.ops.ArrayOps`."""


@runtime_checkable
class FP8ArrayOps(ArrayOps, Protocol):
    """What a backend adds to :class:`~mp_callbacks.ops.ArrayOps` to evaluate :func:`next_fp8_state`.

    A history is a float32 vector of ``history_len`` elements; the vector ops
    act on its last axis.  Like the scalar ops, none converts to a Python value.
    """

    def divide(self, a: Array, b: Array) -> Array:
        """``a / b`` in ``a``'s dtype (float32; ``x / 0`` is inf, ``0 / 0`` NaN, overflow inf)."""

    def reduce_max(self, v: Array) -> Array:
        """The largest element of a history, as a scalar (NaN never reaches a history here)."""

    def roll_left(self, v: Array) -> Array:
        """``[v1, ..., v(n-1), v0]``: ``roll(v, -1)`` along the last axis."""

    def set_first(self, v: Array, value: Array) -> Array:
        """A copy of ``v`` with element 0 replaced by the scalar ``value`` (no in-place write)."""

    def zeros(self, length: int) -> Array:
        """A float32 vector of ``length`` zeros."""


class NumpyFP8Ops(NumpyOps):
    """The NumPy reference backend with the FP8 vector ops.

    It also steps a batch of independent states at once (leading axes on every
    field, one more on the history): a condition with fewer axes than the
    values it selects between applies along their leading axes.
    """

    def where(self, cond, a, b):
        cond, a = np.asarray(cond), np.asarray(a)
        if cond.ndim < a.ndim:
            cond = cond.reshape(cond.shape + (1,) * (a.ndim - cond.ndim))
        return np.asarray(np.where(cond, a, np.asarray(b, dtype=a.dtype)), dtype=a.dtype)

    def divide(self, a, b):
        with np.errstate(divide="ignore", over="ignore", under="ignore", invalid="ignore"):
            return np.asarray(np.divide(a, b, dtype=np.asarray(a).dtype))

    def reduce_max(self, v):
        return np.max(v, axis=-1)

    def roll_left(self, v):
        return np.roll(v, -1, axis=-1)

    def set_first(self, v, value):
        out = np.array(v, copy=True)
        out[..., 0] = value
        return out

    def zeros(self, length: int):
        return np.zeros(int(length), dtype=np.float32)


NUMPY_FP8_OPS = NumpyFP8Ops()
"""The shared instance of the NumPy reference backend with the FP8 ops."""


def fp8_ops(ops: Any) -> Any:
    """``ops`` if it provides every FP8 op; the NumPy FP8 backend for a plain :class:`NumpyOps`.

    Any other backend lacking an op is a ``TypeError`` naming what is missing.
    """
    missing = [name for name in FP8_OP_NAMES if not callable(getattr(ops, name, None))]
    if not missing:
        return ops
    if isinstance(ops, NumpyOps):
        return NUMPY_FP8_OPS
    raise TypeError(
        f"{type(ops).__name__} cannot evaluate the FP8 scaling transition: it lacks {', '.join(missing)} "
        "(see mp_callbacks.fp8.scaling.FP8ArrayOps)"
    )


# -- state and the transition ---------------------------------------------------------------


class FP8State(NamedTuple):
    """One tensor's FP8 scaling state, as backend values.

    ``amax_history`` is a float32 vector of ``history_len`` elements (layout in
    the module docstring); ``scale`` (multiply before the cast) and
    ``scale_inv`` (multiply after, to dequantize) are float32 scalars;
    ``steps`` (transitions) and ``skipped`` (non-finite amaxes) are int32.
    """

    amax_history: Array
    scale: Array
    scale_inv: Array
    steps: Array
    skipped: Array


FP8_STATE_FIELDS = FP8State._fields
"""Field names of :class:`FP8State`, in order."""


def initial_fp8_state(config: FP8ScalingConfig, ops: Any = NUMPY_FP8_OPS) -> FP8State:
    """The state before the first step: an all-zero history, scale and scale_inv 1 (both anchors)."""
    ops = fp8_ops(ops)
    zero = ops.i32(0)
    return FP8State(amax_history=ops.zeros(config.history_len), scale=ops.f32(1.0), scale_inv=ops.f32(1.0),
                    steps=zero, skipped=zero)


def _epsilon_constants(config: FP8ScalingConfig) -> tuple[float, float]:
    """``(threshold, scale_at_epsilon)`` for ``amax_epsilon``, exact as torchao computes in float64.

    A float32 window is below the float64 epsilon exactly when it is below the
    smallest float32 >= epsilon; the scale there is ``scaled_max / epsilon``
    in float64, rounded once to float32.
    """
    eps = config.amax_epsilon
    threshold = np.float32(eps)
    if float(threshold) < eps:
        threshold = np.nextafter(threshold, np.float32(np.inf))
    return float(threshold), float(np.float32(config.scaled_max / eps))


def next_fp8_state(config: FP8ScalingConfig, state: FP8State, amax: Array,
                   ops: Any = NUMPY_FP8_OPS) -> tuple[FP8State, Array]:
    """One step of one tensor's FP8 scaling: returns ``(new_state, ok)``.

    ``amax`` is a float32 backend scalar: max |x| over this step's tensor,
    already reduced over data-parallel ranks.  ``ok`` is False when it is not
    finite: the state is then returned unchanged apart from its counters, and
    the step must be skipped.  Pure and branch-free: traceable by every backend
    that has the :class:`FP8ArrayOps`.  The rule is the module docstring's.
    """
    ops = fp8_ops(ops)
    amax = ops.f32(amax)
    ok = ops.isfinite(amax)
    history = state.amax_history

    # Record this step's amax; pick the window's amax.
    if config.update_order == "record_first":  # TE: the forward writes slot 0, the update rolls and zeroes it
        with_current = ops.set_first(history, amax)
        recorded = ops.set_first(ops.roll_left(with_current), ops.f32(0.0))
        use_max = config.mode == "delayed" and config.amax_algo == "max"
        window = ops.reduce_max(with_current) if use_max else amax
    else:  # Keras: the scale from the history as it was, then roll and write slot 0
        recorded = ops.set_first(ops.roll_left(history), amax)
        window = ops.reduce_max(history) if config.mode == "delayed" else amax

    # The scale from the window.
    previous = state.scale if config.stored == "scale" else ops.divide(ops.f32(1.0), state.scale_inv)
    scale = ops.divide(ops.f32(config.scaled_max), window)
    if config.amax_epsilon > 0:
        threshold, at_epsilon = _epsilon_constants(config)
        scale = ops.where(ops.greater_equal(window, ops.f32(threshold)), scale, ops.f32(at_epsilon))
        usable = ops.isfinite(window)
    else:  # window > 0, written with the protocol's comparisons (NaN is caught by isfinite)
        usable = ops.logical_and(ops.isfinite(window), ops.logical_not(ops.less_equal(window, ops.f32(0.0))))
    scale = ops.where(usable, scale, previous)
    if config.clamp_inf_scale:
        scale = ops.where(ops.isfinite(scale), scale, ops.f32(FLOAT32_MAX))
    scale_inv = ops.divide(ops.f32(1.0), scale)

    new = FP8State(
        amax_history=ops.where(ok, recorded, history),
        scale=ops.where(ok, scale, state.scale),
        scale_inv=ops.where(ok, scale_inv, state.scale_inv),
        steps=ops.add(state.steps, ops.i32(1)),
        skipped=ops.add(state.skipped, ops.where(ok, ops.i32(0), ops.i32(1))),
    )
    return new, ok


def select_fp8_state(cond: Array, new: FP8State, old: FP8State, ops: Any = NUMPY_FP8_OPS) -> FP8State:
    """``new``'s scaling (history, scale, scale_inv) where ``cond``, else ``old``'s; ``new``'s counters.

    For an adapter that skips every tensor's float8 update on a skipped step
    (as Keras does under ``LossScaleOptimizer``):
    ``select_fp8_state(applied, new, old)``.  The counters still advance: the
    step was seen, and a non-finite amax is counted in ``skipped``.
    """
    ops = fp8_ops(ops)
    return new._replace(amax_history=ops.where(cond, new.amax_history, old.amax_history),
                        scale=ops.where(cond, new.scale, old.scale),
                        scale_inv=ops.where(cond, new.scale_inv, old.scale_inv))


# -- plain-data state ---------------------------------------------------------------------


def fp8_state_to_dict(state: FP8State) -> dict[str, Any]:
    """Plain data from backend values (one host read; for checkpoints and logs)."""
    return {
        "amax_history": [float(v) for v in np.asarray(state.amax_history, dtype=np.float32).reshape(-1)],
        "scale": float(np.asarray(state.scale, dtype=np.float32)),
        "scale_inv": float(np.asarray(state.scale_inv, dtype=np.float32)),
        "steps": int(np.asarray(state.steps)),
        "skipped": int(np.asarray(state.skipped)),
    }


def fp8_state_from_dict(config: FP8ScalingConfig, data: Mapping[str, Any]) -> FP8State:
    """NumPy values from plain data, checked against ``config`` (a ``ValueError`` names what is wrong).

    Adapters copy the arrays into their own tensors or variables.
    """
    missing = [name for name in FP8_STATE_FIELDS if name not in data]
    if missing:
        raise ValueError(f"FP8 state is missing {missing}; expected fields {list(FP8_STATE_FIELDS)}")
    history = np.asarray(data["amax_history"], dtype=np.float32)
    if history.shape != (config.history_len,) or not (np.isfinite(history).all() and (history >= 0).all()):
        raise ValueError(f"FP8 state: amax_history must be {config.history_len} finite numbers >= 0 "
                         f"(history_len), got shape {history.shape}")
    for name in ("scale", "scale_inv"):
        if not is_number(data[name]) or not data[name] >= 0:
            raise ValueError(f"FP8 state: {name}={data[name]!r} must be a number >= 0")
    for name in ("steps", "skipped"):
        if not is_int(data[name]) or data[name] < 0:
            raise ValueError(f"FP8 state: {name}={data[name]!r} must be a non-negative integer")
    return FP8State(amax_history=history, scale=np.asarray(data["scale"], dtype=np.float32),
                    scale_inv=np.asarray(data["scale_inv"], dtype=np.float32),
                    steps=np.asarray(data["steps"], dtype=np.int32),
                    skipped=np.asarray(data["skipped"], dtype=np.int32))
