"""Dynamic loss scaling: the one transition, its state, and the checkpoint record.

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

The settings (:class:`ScalerConfig`, :data:`PRESETS`) live in
:mod:`mp_callbacks.loss_scale.config` and are re-exported here.
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Mapping, NamedTuple

import numpy as np

from ..ops import NUMPY_OPS, Array, ArrayOps
from .config import FLOAT32_MAX, FLOAT32_TINY, ON_MIN_SCALE_CHOICES, PRESETS, ConfigError, ScalerConfig, _is_number

SCHEMA_VERSION = 1
"""Version of the scaler's checkpoint record (:func:`make_state_dict`)."""


class StateDictError(ValueError):
    """A state dict does not fit: wrong schema version, missing key, bad value."""


class ScaleFloorError(RuntimeError):
    """Gradients keep overflowing while the loss scale sits at ``min_scale``."""


class ScaleFloorWarning(RuntimeWarning):
    """Gradients overflowed while the loss scale sits at ``min_scale``."""


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


def next_state(
    config: ScalerConfig, state: ScalerState, found_inf: Array, ops: ArrayOps = NUMPY_OPS
) -> tuple[ScalerState, Array]:
    """One step of the scaler: returns ``(new_state, applied)``.

    ``found_inf`` is a boolean backend scalar: any non-finite gradient in the
    step, already reduced over data-parallel ranks.  ``applied`` is False when
    the step must be skipped.  Pure and branch-free: traceable by every backend.
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


def react_to_floor_hit(config: ScalerConfig, step: int, scale: float, stacklevel: int = 3) -> None:
    """Apply ``config.on_min_scale`` to a floor hit seen at ``step``: raise, warn, or nothing (clamp).

    ``stacklevel`` is the warning's, counted from the caller of this function.
    """
    if config.on_min_scale == "clamp":
        return
    message = floor_message(step, scale, config)
    if config.on_min_scale == "raise":
        raise ScaleFloorError(message)
    warnings.warn(message, ScaleFloorWarning, stacklevel=stacklevel)


class ScalerCounters:
    """The running counters as int properties, for any owner of a scaler state (a mix-in).

    The owner implements ``_counter(name) -> int`` (a host read of one of
    :data:`COUNTER_FIELDS`).
    """

    def _counter(self, name: str) -> int:  # pragma: no cover - implemented by the owner
        raise NotImplementedError

    steps = property(lambda self: self._counter("steps"), doc="Scaler transitions (optimizer steps seen).")
    overflows = property(lambda self: self._counter("overflows"), doc="Steps whose gradients held inf/NaN.")
    skipped = property(lambda self: self._counter("skipped"), doc="Steps whose update was skipped.")
    growths = property(lambda self: self._counter("growths"), doc="Times the scale grew.")
    floor_hits = property(lambda self: self._counter("floor_hits"),
                          doc="Overflows that asked for a backoff while the scale sat at ``min_scale``.")


# -- plain-data state -----------------------------------------------------------


def state_to_dict(state: ScalerState) -> dict[str, float | int]:
    """Python numbers from backend scalars (one host sync; for checkpoints and logs)."""
    out: dict[str, float | int] = {"scale": float(np.asarray(state.scale, dtype=np.float32))}
    for name in STATE_FIELDS[1:]:
        out[name] = int(np.asarray(getattr(state, name)))
    return out


def validate_state_fields(data: Mapping[str, Any], where: str = "scaler state") -> dict[str, float | int]:
    """Check a plain-data state: every field present, scale a positive finite float32."""
    missing = [name for name in STATE_FIELDS if name not in data]
    if missing:
        raise StateDictError(f"{where} is missing {missing}; expected fields {list(STATE_FIELDS)}")
    out: dict[str, float | int] = {}
    scale = data["scale"]
    if not _is_number(scale) or not math.isfinite(scale) or scale <= 0:
        raise StateDictError(f"{where}: scale={scale!r} must be a positive finite number")
    out["scale"] = float(scale)
    for name in STATE_FIELDS[1:]:
        value = data[name]
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 0:
            raise StateDictError(f"{where}: {name}={value!r} must be a non-negative integer")
        out[name] = int(value)
    return out


def state_from_dict(data: Mapping[str, Any], ops: ArrayOps = NUMPY_OPS) -> ScalerState:
    """Backend scalars from plain data (validated)."""
    clean = validate_state_fields(data)
    return ScalerState(
        scale=ops.f32(clean["scale"]), **{name: ops.i32(clean[name]) for name in STATE_FIELDS[1:]}
    )


def make_state_dict(config: ScalerConfig, state: ScalerState) -> dict[str, Any]:
    """The versioned checkpoint record of a scaler."""
    return {"schema_version": SCHEMA_VERSION, "config": config.to_dict(), "state": state_to_dict(state)}


def check_state_dict(config: ScalerConfig, sd: Mapping[str, Any]) -> dict[str, float | int]:
    """Validate a checkpoint record against ``config``; return its plain state.

    A different schema version, a different config or a malformed state is an
    error naming both sides, never a silent reset.
    """
    if not isinstance(sd, Mapping):
        raise StateDictError(f"a scaler state dict must be a dict, not {type(sd).__name__}")
    version = sd.get("schema_version")
    if version != SCHEMA_VERSION:
        raise StateDictError(
            f"scaler state dict has schema_version={version!r}; this version of mp_callbacks reads {SCHEMA_VERSION}"
        )
    for key in ("config", "state"):
        if not isinstance(sd.get(key), Mapping):
            raise StateDictError(f"scaler state dict lacks a {key!r} dict")
    try:
        saved = ScalerConfig.from_dict(sd["config"])
    except (ConfigError, TypeError) as exc:
        raise StateDictError(f"scaler state dict holds an invalid config: {exc}") from exc
    if saved != config:
        diffs = {
            k: (v, getattr(config, k)) for k, v in saved.to_dict().items() if getattr(config, k) != v
        }
        detail = ", ".join(f"{k}: saved {a!r} vs current {b!r}" for k, (a, b) in diffs.items())
        raise StateDictError(f"scaler state dict was saved with a different config ({detail})")
    return validate_state_fields(sd["state"])


def floor_message(step: int, scale: float, config: ScalerConfig) -> str:
    """The text of a floor hit: what was seen and what to try."""
    return (
        f"gradients overflowed at step {step} while the loss scale sits at its floor "
        f"(scale={scale:g}, min_scale={config.min_scale:g}). Try: lower the learning rate, "
        "switch to bf16 (wider range), keep more ops in FP32 (norms, softmax, losses, custom ops), "
        "or check the data for extreme values."
    )


class DynamicLossScaler(ScalerCounters):
    """Eager Python front end of the transition (NumPy float32 reference).

    >>> s = DynamicLossScaler(ScalerConfig.preset("torch"))
    >>> s.scale, s.update(found_inf=True), s.scale
    (65536.0, False, 32768.0)
    """

    def __init__(self, config: ScalerConfig | str | Mapping[str, Any] | None = None) -> None:
        self.config = ScalerConfig.coerce(config)
        self._state = initial_state(self.config)

    # -- reading ------------------------------------------------------------------
    @property
    def state(self) -> ScalerState:
        """The current state (NumPy scalars)."""
        return self._state

    @property
    def scale(self) -> float:
        """The current loss scale."""
        return float(self._state.scale)

    def _counter(self, name: str) -> int:
        return int(getattr(self._state, name))


    # -- stepping -----------------------------------------------------------------
    def scale_loss(self, loss: Any) -> Any:
        """``loss * scale``."""
        return loss * self.scale

    def update(self, found_inf: bool) -> bool:
        """Advance one step; True when the step's update is applied."""
        new, applied = next_state(self.config, self._state, bool(found_inf))
        hit = int(new.floor_hits) > int(self._state.floor_hits)
        self._state = new
        if hit:
            react_to_floor_hit(self.config, int(new.steps), float(new.scale))
        return bool(applied)

    # -- checkpoints ----------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Plain data with a schema version."""
        return make_state_dict(self.config, self._state)

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore; a mismatched or corrupt dict raises :class:`StateDictError`."""
        self._state = state_from_dict(check_state_dict(self.config, state_dict))

    def __repr__(self) -> str:
        return (
            f"DynamicLossScaler(scale={self.scale:g}, steps={self.steps}, overflows={self.overflows}, "
            f"skipped={self.skipped}, growths={self.growths})"
        )
