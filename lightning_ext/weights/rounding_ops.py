"""The core's rounding ops (:class:`mp_callbacks.weights.RoundingOps`) over torch tensors.

What :mod:`lightning_ext.weights.rounding` evaluates the core's Kahan and
stochastic-rounding rules with: bit for bit the NumPy reference's numbers and
the Keras adapter's (u32 values held as int32 with the same bits).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from mp_callbacks.weights import s32

__all__ = ["TorchRoundingOps"]


class TorchRoundingOps:
    """:class:`mp_callbacks.weights.RoundingOps` over torch tensors; u32 values live in int32 tensors
    (same bits; multiplication and addition wrap modulo ``2**32``, ``shr`` masks the sign extension).
    The integer operations work in place on their first argument, as the protocol allows."""

    def to_f32(self, a: Tensor) -> Tensor:
        return a.to(torch.float32)

    def to_like(self, x: Tensor, like: Tensor) -> Tensor:
        return x.to(like.dtype)

    def add(self, a: Tensor, b: Tensor) -> Tensor:
        return a + b

    def sub(self, a: Tensor, b: Tensor) -> Tensor:
        return a - b

    def isnan(self, a: Tensor) -> Tensor:
        return torch.isnan(a)

    def where(self, cond: Tensor, a: Tensor, b: Tensor) -> Tensor:
        return torch.where(cond, a, b)

    def u32(self, value: Any) -> Any:
        return value if isinstance(value, Tensor) else s32(int(value))

    def index(self, like: Tensor) -> Tensor:
        return torch.arange(like.numel(), dtype=torch.int32, device=like.device).reshape(like.shape)

    def xor(self, a: Any, b: Any) -> Tensor:
        if not isinstance(a, Tensor):
            return torch.bitwise_xor(b, self.u32(a))
        return a.bitwise_xor_(self.u32(b))

    def shr(self, a: Tensor, k: int) -> Tensor:
        return torch.bitwise_right_shift(a, k).bitwise_and_((1 << (32 - k)) - 1)

    def mul(self, a: Tensor, k: int) -> Tensor:
        return a.mul_(s32(k))

    def add_u32(self, a: Tensor, b: Any) -> Tensor:
        return a.add_(self.u32(b))

    def f32_bits(self, x: Tensor) -> Tensor:
        return x.to(torch.float32).contiguous().view(torch.int32)

    def bf16_from_bits(self, bits: Any) -> Tensor:
        if not isinstance(bits, Tensor):
            return torch.tensor(s32(bits) >> 16, dtype=torch.int16).view(torch.bfloat16)
        # arithmetic shift then int16: the upper 16 bits, exactly
        return bits.bitwise_right_shift_(16).to(torch.int16).view(torch.bfloat16)


TORCH_ROUNDING_OPS = TorchRoundingOps()
