"""Canonical floating-point dtype names and their numeric facts (no framework imports)."""

from __future__ import annotations

from dataclasses import dataclass

CANONICAL = ("float32", "float16", "bfloat16")

ALIASES: dict[str, str] = {
    "float32": "float32", "fp32": "float32", "f32": "float32", "float": "float32", "32": "float32",
    "float16": "float16", "fp16": "float16", "f16": "float16", "half": "float16", "16": "float16",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
}


@dataclass(frozen=True)
class FloatFormat:
    """Bit layout and range of a floating-point format."""

    name: str
    bytes: int
    mantissa_bits: int  # explicit fraction bits
    max: float
    tiny: float  # smallest positive normal
    smallest_subnormal: float

    @property
    def eps(self) -> float:
        """Spacing of representable numbers just above 1.0."""
        return 2.0 ** -self.mantissa_bits


FORMATS: dict[str, FloatFormat] = {
    "float32": FloatFormat("float32", 4, 23, 3.4028234663852886e38, 2.0**-126, 2.0**-149),
    "float16": FloatFormat("float16", 2, 10, 65504.0, 2.0**-14, 2.0**-24),
    "bfloat16": FloatFormat("bfloat16", 2, 7, 3.3895313892515355e38, 2.0**-126, 2.0**-133),
}


def canonical_dtype(name: object, field: str = "dtype") -> str:
    """``"bf16"`` -> ``"bfloat16"``; accepts framework dtype objects by their name.

    Raises ``ValueError`` naming the field, the value and the valid names.
    """
    text = getattr(name, "name", None) or str(name)
    text = text.replace("torch.", "").strip().lower()
    if text in ALIASES:
        return ALIASES[text]
    raise ValueError(
        f"{field}={name!r} is not a supported dtype; valid: {', '.join(CANONICAL)} "
        f"(aliases: {', '.join(sorted(k for k in ALIASES if k not in CANONICAL))})"
    )


def dtype_bytes(name: str) -> int:
    """Bytes per element of a canonical dtype."""
    return FORMATS[canonical_dtype(name)].bytes
