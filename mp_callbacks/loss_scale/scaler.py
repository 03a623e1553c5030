"""The loss scaler on the host: the floor reaction, the counters and the eager front end.

A floor hit (an overflow that asks for a backoff while the scale sits at ``min_scale``)
is met by ``config.on_min_scale``: ``clamp`` ignores it, ``warn`` warns
(:class:`ScaleFloorWarning`), ``raise`` raises :class:`ScaleFloorError`; the message
names the step and the scale and says what to try.  :class:`DynamicLossScaler` runs the
transition with NumPy float32 (the reference every backend is tested against).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

from ..advice import checklist
from .config import ScalerConfig
from .record import check_state_dict, make_state_dict, state_from_dict
from .transition import ScalerState, initial_state, next_state


class ScaleFloorError(RuntimeError):
    """Gradients keep overflowing while the loss scale sits at ``min_scale``."""


class ScaleFloorWarning(RuntimeWarning):
    """Gradients overflowed while the loss scale sits at ``min_scale``."""


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


def floor_message(step: int, scale: float, config: ScalerConfig) -> str:
    """The text of a floor hit: what was seen and what to try."""
    return (
        f"gradients overflowed at step {step} while the loss scale sits at its floor "
        f"(scale={scale:g}, min_scale={config.min_scale:g}). Try: {checklist('floor')}."
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
