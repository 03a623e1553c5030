"""Block-quantized optimizer states (torchao's ``AdamW8bit``, ``AdamW4bit``, ``AdamWFp8`` and their Adam twins).

The rule (torchao 0.18, ``torchao.optim``): each of the optimizer's state tensors (Adam: m and v) of a
parameter with at least :attr:`LowBitStates.min_numel` elements and a multiple of ``block_size`` is held
quantized: codes of ``bits`` per element, one float32 scale per block of ``block_size`` elements, and a
float32 lookup table of ``qmap_entries`` values per tensor; any other parameter's states are plain tensors
of the parameter the optimizer updates (FP32 under every recipe here: the masters, or the FP32 value the
rounded recipes hand it), held in the recipe's state dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..weights import BLOCK_SIZE, CODES, MIN_NUMEL


@dataclass(frozen=True)
class LowBitStates:
    """The layout of one low-bit optimizer's states."""

    slots: int
    bits: int
    block_size: int
    qmap_entries: int
    min_numel: int = MIN_NUMEL

    def quantizes(self, numel: int) -> bool:
        """Whether a parameter of ``numel`` elements gets quantized states."""
        return numel >= self.min_numel and numel % self.block_size == 0

    def slot_bytes(self, numel: int, plain_bytes: float) -> int:
        """Bytes of one state tensor of a ``numel``-element parameter (``plain_bytes`` per element when plain)."""
        if self.quantizes(numel):
            return numel * self.bits // 8 + 4 * (numel // self.block_size) + 4 * self.qmap_entries
        return int(numel * plain_bytes)


EIGHT_BIT = LowBitStates(2, 8, BLOCK_SIZE, CODES)
"""The layout of ``state_dtype="8bit"`` (:mod:`mp_callbacks.weights.low_bit`), torchao's ``AdamW8bit``'s: per
quantized state tensor 1 B per element, a float32 scale per block and the 256-entry float32 map."""

LOW_BIT_STATES: dict[str, LowBitStates] = {
    "adamw8bit": EIGHT_BIT, "adam8bit": EIGHT_BIT,
    "adamw4bit": LowBitStates(2, 4, 128, 16), "adam4bit": LowBitStates(2, 4, 128, 16),
    "adamwfp8": LowBitStates(2, 8, 256, 0), "adamfp8": LowBitStates(2, 8, 256, 0),
}
"""Optimizer name (lower case, as :func:`~mp_callbacks.memory.estimate.optimizer_kind` makes it) -> its layout."""
