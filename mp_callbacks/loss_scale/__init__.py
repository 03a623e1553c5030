"""Loss scaling: the settings and presets, the one pure transition, its checkpoint record, the host front end.

* :mod:`.config`: :class:`ScalerConfig` (validated settings) and :data:`PRESETS` (torch, keras,
  tf-keras, megatron, deepspeed, apex, jmp);
* :mod:`.transition`: :class:`ScalerState`, :func:`initial_state`, :func:`next_state` (pure,
  over the array-ops protocol), :func:`moving_fields`, :func:`fixed_scale`, :func:`checks_overflow`;
* :mod:`.record`: the versioned checkpoint record (:func:`make_state_dict`, :func:`check_state_dict`);
* :mod:`.scaler`: the floor reaction (:class:`ScaleFloorError`) and :class:`DynamicLossScaler`
  (the NumPy float32 reference).
"""

from .config import (
    FLOAT32_MAX,
    FLOAT32_TINY,
    ON_MIN_SCALE_CHOICES,
    PRESETS,
    ScalerConfig,
)
from .record import (
    SCHEMA_VERSION,
    check_state_dict,
    make_state_dict,
    state_from_dict,
    state_to_dict,
    validate_state_fields,
)
from .scaler import (
    DynamicLossScaler,
    ScaleFloorError,
    ScaleFloorWarning,
    ScalerCounters,
    floor_message,
    react_to_floor_hit,
)
from .transition import (
    COUNTER_FIELDS,
    STATE_FIELDS,
    ScalerState,
    check_count_overflows,
    checks_overflow,
    fixed_scale,
    initial_state,
    moving_fields,
    next_state,
)

__all__ = [
    "COUNTER_FIELDS",
    "DynamicLossScaler",
    "FLOAT32_MAX",
    "FLOAT32_TINY",
    "ON_MIN_SCALE_CHOICES",
    "PRESETS",
    "SCHEMA_VERSION",
    "STATE_FIELDS",
    "ScaleFloorError",
    "ScaleFloorWarning",
    "ScalerConfig",
    "ScalerCounters",
    "ScalerState",
    "check_count_overflows",
    "check_state_dict",
    "checks_overflow",
    "fixed_scale",
    "floor_message",
    "initial_state",
    "make_state_dict",
    "moving_fields",
    "next_state",
    "react_to_floor_hit",
    "state_from_dict",
    "state_to_dict",
    "validate_state_fields",
]
