"""Dynamic loss scaling: the one transition and its state.

The rule (every preset is a setting of it)::

    on overflow:   growth_tracker = 0
                   hysteresis_left = max(hysteresis_left - 1, 0)
                   if hysteresis_left == 0:
                       scale = max(scale * backoff_factor, min_scale)
                   the step is skipped
    on clean step: growth_tracker += 1
                   if consecutive_hysteresis: hysteresis_left = hysteresis
                   if growth_tracker == growth_interval:
                       growth_tracker = 0
                       hysteresis_left = hysteresis
                       if isfinite(scale * growth_factor):
                           scale = min(scale * growth_factor, max_scale)

The scale is a float32 number; everything is evaluated in float32 exactly as
the anchors do (powers of two stay exact).  An overflow that asks for a backoff
while the scale already sits at ``min_scale`` is a *floor hit*: ``clamp``
ignores it, ``warn`` warns, ``raise`` raises :class:`ScaleFloorError`.

``enabled=False`` turns scaling off: the scale is 1.0; a step whose gradients
are not finite is still skipped (``skip_nonfinite=True``, the default: nothing
non-finite reaches the weights in any recipe), or, with
``skip_nonfinite=False``, applied and counted when the adapter looks
(:func:`checks_overflow`).  ``dynamic=False`` keeps the scale at
``init_scale`` forever but still skips steps whose gradients are not finite.

The settings are :class:`~mp_callbacks.loss_scale.config.ScalerConfig`; the floor
reaction and the eager front end :mod:`~mp_callbacks.loss_scale.scaler`; the checkpoint
record :mod:`~mp_callbacks.loss_scale.record`.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from ..ops import NUMPY_OPS, Array, ArrayOps
from .config import ScalerConfig


class ScalerState(NamedTuple):
    """Everything the transition reads and writes, as backend scalars.

    ``scale`` is float32; all other fields are int32.
    """

    scale: Array
    growth_tracker: Array
    hysteresis_left: Array
    steps: Array
    overflows: Array
    skipped: Array
    growths: Array
    floor_hits: Array


STATE_FIELDS = ScalerState._fields
"""Field names of :class:`ScalerState`, in order (scale first)."""
COUNTER_FIELDS = ("steps", "overflows", "skipped", "growths", "floor_hits")
"""The running counters among :data:`STATE_FIELDS`."""


def initial_state(config: ScalerConfig, ops: ArrayOps = NUMPY_OPS) -> ScalerState:
    """The state before the first step."""
    scale = config.init_scale if config.enabled else 1.0
    zero = ops.i32(0)
    return ScalerState(
        scale=ops.f32(scale),
        growth_tracker=zero,
        hysteresis_left=ops.i32(config.hysteresis),
        steps=zero,
        overflows=zero,
        skipped=zero,
        growths=zero,
        floor_hits=zero,
    )


def moving_fields(config: ScalerConfig) -> tuple[str, ...]:
    """The fields of :class:`ScalerState` that :func:`next_state` can change under ``config``, in
    :data:`STATE_FIELDS` order.  It neither reads nor changes the others (it returns them as given: they
    may be None), so an adapter need not read or write them: with scaling off the scale (1), growth
    tracker, hysteresis, growths and floor hits cannot move, nor, with a fixed scale, all but the counters.

    >>> moving_fields(ScalerConfig(enabled=False))
    ('steps', 'overflows', 'skipped')
    >>> moving_fields(ScalerConfig(enabled=False, skip_nonfinite=False))
    ('steps', 'overflows')
    >>> moving_fields(ScalerConfig.preset("torch")) == STATE_FIELDS
    True
    """
    if config.enabled and config.dynamic:
        return STATE_FIELDS
    if not config.enabled and not config.skip_nonfinite:
        return ("steps", "overflows")
    return ("steps", "overflows", "skipped")


def fixed_scale(config: ScalerConfig) -> float | None:
    """The scale every step runs with when ``config`` cannot move it from a known value: 1.0 with scaling
    off; None otherwise (a dynamic scale, or a fixed one that a checkpoint may have set)."""
    return None if config.enabled else 1.0


def next_state(
    config: ScalerConfig, state: ScalerState, found_inf: Array, ops: ArrayOps = NUMPY_OPS
) -> tuple[ScalerState, Array]:
    """One step of the scaler: returns ``(new_state, applied)``.

    ``found_inf`` is a boolean backend scalar: any non-finite gradient in the
    step, already reduced over data-parallel ranks.  ``applied`` is False when
    the step must be skipped.  Pure and branch-free: traceable by every backend.
    Fields outside :func:`moving_fields` are returned as given (the same objects), never read.
    """
    found_inf = ops.boolean(found_inf)
    if not config.enabled:  # no scale to move: skip non-finite steps (skip_nonfinite) or only count them
        if config.skip_nonfinite:
            return _counted(state, ops, found_inf, skipped=found_inf, grew=None, floor_hit=None), \
                ops.logical_not(found_inf)
        return _counted(state, ops, found_inf, skipped=None, grew=None, floor_hit=None), ops.boolean(True)
    clean = ops.logical_not(found_inf)
    if not config.dynamic:  # a fixed scale: skip non-finite steps, never move
        return _counted(state, ops, found_inf, skipped=found_inf, grew=None, floor_hit=None), clean

    zero, scale = ops.i32(0), state.scale
    min_scale = ops.f32(config.min_scale)
    # Overflow branch.
    hyst_after = ops.maximum(ops.add(state.hysteresis_left, ops.i32(-1)), zero)
    backoff = ops.logical_and(found_inf, ops.less_equal(hyst_after, zero))
    backed = ops.maximum(ops.mul(scale, ops.f32(config.backoff_factor)), min_scale)
    floor_hit = ops.logical_and(backoff, ops.less_equal(scale, min_scale))
    # Clean branch.
    tracker_after = ops.add(state.growth_tracker, ops.i32(1))
    grow = ops.logical_and(clean, ops.greater_equal(tracker_after, ops.i32(config.growth_interval)))
    candidate = ops.mul(scale, ops.f32(config.growth_factor))
    grown = ops.where(ops.isfinite(candidate), ops.minimum(candidate, ops.f32(config.max_scale)), scale)

    new_scale = ops.where(backoff, backed, ops.where(grow, grown, scale))
    refill = clean if config.consecutive_hysteresis else grow
    moved = state._replace(
        scale=new_scale,
        growth_tracker=ops.where(ops.logical_or(found_inf, grow), zero, tracker_after),
        hysteresis_left=ops.where(
            found_inf, hyst_after, ops.where(refill, ops.i32(config.hysteresis), state.hysteresis_left)),
    )
    grew = ops.logical_and(grow, ops.not_equal(new_scale, scale))
    return _counted(moved, ops, found_inf, skipped=found_inf, grew=grew, floor_hit=floor_hit), clean


def _counted(state: ScalerState, ops: ArrayOps, found_inf: Array, skipped: Array | None, grew: Array | None,
             floor_hit: Array | None) -> ScalerState:
    """``state`` with every running counter advanced by one step's flags (the one place counters move).

    A flag given as None cannot be set in this configuration: its counter stays.
    """
    one, zero = ops.i32(1), ops.i32(0)

    def plus(counter: Array, flag: Array | None) -> Array:
        return counter if flag is None else ops.add(counter, ops.where(flag, one, zero))

    return state._replace(
        steps=ops.add(state.steps, one),
        overflows=plus(state.overflows, found_inf),
        skipped=plus(state.skipped, skipped),
        growths=plus(state.growths, grew),
        floor_hits=plus(state.floor_hits, floor_hit),
    )


def checks_overflow(config: ScalerConfig, count_overflows: bool | None = None, monitored: bool = False) -> bool:
    """Whether a step must look for inf/NaN gradients (a pass over every gradient).

    Rule: always when the step can be skipped (:attr:`ScalerConfig.can_skip`:
    loss scaling on, or ``skip_nonfinite``), since the decision needs it.
    Otherwise the check only feeds the overflow counter, a diagnostic:
    ``count_overflows`` decides when given (True/False); by default (None) the
    check runs exactly when a diagnostics monitor is attached (``monitored``).
    A step that does not check reports no overflow.

    >>> checks_overflow(ScalerConfig.preset("torch"), count_overflows=False)
    True
    >>> off = ScalerConfig(enabled=False, skip_nonfinite=False)
    >>> checks_overflow(off), checks_overflow(off, monitored=True), checks_overflow(ScalerConfig(enabled=False))
    (False, True, True)
    """
    if config.can_skip:
        return True
    if count_overflows is not None:
        return bool(count_overflows)
    return bool(monitored)


def check_count_overflows(value: Any) -> bool | None:
    """``count_overflows`` as given: True, False or None; anything else is a ``TypeError``."""
    if value is not None and not isinstance(value, bool):
        raise TypeError(f"count_overflows must be True, False or None, not {value!r}")
    return value
