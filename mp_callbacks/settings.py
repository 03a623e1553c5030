"""Frozen settings: the one base of the core's validated config dataclasses, and its two errors.

A settings class is a frozen dataclass (validated in ``__post_init__``) that

* ``coerce(value)``s what users pass: the class itself (kept), ``None`` or a name
  (:meth:`Settings.from_name`: a preset), or a dict of fields (:meth:`Settings.from_dict`);
  anything else is its ``error`` naming what it accepts;
* ``replace(**changes)``s (validated again), ``to_dict()``s every field by name and reads
  it back with ``from_dict``, where an unknown key is an error listing the valid ones.

:class:`ConfigError` is a value out of its allowed range; :class:`StateDictError` a
checkpoint record that does not fit (wrong schema version, missing key, bad value).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar, TypeVar

import numpy as np

S = TypeVar("S", bound="Settings")


class ConfigError(ValueError):
    """A configuration value is out of its allowed range."""


class StateDictError(ValueError):
    """A state dict does not fit: wrong schema version, missing key, bad value."""


def is_number(value: Any) -> bool:
    """A Python or NumPy real number (``bool`` is not one)."""
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)


def is_int(value: Any) -> bool:
    """A Python or NumPy integer (``bool`` is not one)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


class Settings:
    """Mix-in of a frozen dataclass: ``coerce``, ``replace``, ``to_dict``, ``from_dict``.

    A subclass sets ``error`` (raised for a bad value or an unknown field), ``what`` (how an
    error names the value, e.g. ``"a scaler"``) and implements :meth:`from_name`.
    """

    error: ClassVar[type[Exception]] = ConfigError
    what: ClassVar[str] = "a setting"

    @classmethod
    def from_name(cls: type[S], name: str | None, *args: Any, **kwargs: Any) -> S:
        """The settings a name (a preset) stands for; ``None``: the default."""
        raise cls.error(f"{cls.__name__} has no named presets")

    @classmethod
    def coerce(cls: type[S], value: Any, *args: Any, **kwargs: Any) -> S:
        """Accept the settings, a preset name, a dict of fields, or ``None`` (the default)."""
        if isinstance(value, cls):
            return value
        if value is None or isinstance(value, str):
            return cls.from_name(value, *args, **kwargs)
        if isinstance(value, Mapping):
            return cls.from_dict(value)
        raise cls.error(f"{cls.what} must be a {cls.__name__}, a preset name or a dict, not {type(value).__name__}")

    def replace(self: S, **changes: Any) -> S:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)  # type: ignore[type-var]

    def to_dict(self) -> dict[str, Any]:
        """Plain data: every field by name."""
        return dataclasses.asdict(self)  # type: ignore[call-overload]

    @classmethod
    def from_dict(cls: type[S], data: Mapping[str, Any]) -> S:
        """Inverse of :meth:`to_dict`; unknown keys are an error that lists the valid ones."""
        names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        unknown = sorted(set(data) - names)
        if unknown:
            raise cls.error(f"unknown {cls.__name__} field(s) {unknown}; valid fields: {sorted(names)}")
        return cls(**dict(data))
