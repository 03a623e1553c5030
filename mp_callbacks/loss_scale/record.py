"""The loss scaler's checkpoint record: its plain-data state, versioned and validated.

``make_state_dict(config, state)`` is ``{"schema_version", "config", "state"}``;
``check_state_dict`` reads one back against the running config: a different schema
version, a different config or a malformed state is a
:class:`~mp_callbacks.settings.StateDictError` naming both sides, never a silent reset.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from ..ops import NUMPY_OPS, ArrayOps
from ..settings import ConfigError, StateDictError, is_number
from .config import ScalerConfig
from .transition import STATE_FIELDS, ScalerState

SCHEMA_VERSION = 1
"""Version of the scaler's checkpoint record (:func:`make_state_dict`)."""


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
    if not is_number(scale) or not math.isfinite(scale) or scale <= 0:
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
