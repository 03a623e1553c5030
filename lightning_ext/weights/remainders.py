"""The core's bf16 + 16-bit remainder split of FP32 masters (:mod:`mp_callbacks.weights.remainders`) on torch tensors.

A contiguous float32 tensor viewed as int16 holds ``(lower, upper)`` pairs (every
device torch runs on is little-endian); the core's :func:`~mp_callbacks.weights.forward_half`
and :func:`~mp_callbacks.weights.upper_half` run on those halves as int16 tensors, written
into the destination (per tensor: one strided copy and one int16 subtraction, no FP32 temporary).
"""

from __future__ import annotations

import sys

import torch
from torch import Tensor

from mp_callbacks.weights import forward_half, upper_half

if sys.byteorder != "little":  # pragma: no cover - torch's devices are little-endian
    raise ImportError("lightning_ext.weights.remainders reads float32 halves in little-endian order")


def _halves(fp32: Tensor) -> tuple[Tensor, Tensor]:
    pairs = fp32.view(-1).view(torch.int16).view(-1, 2)
    return pairs[:, 0], pairs[:, 1]


def split_into(master: Tensor, low: Tensor, remainder: Tensor) -> None:
    """Write FP32 ``master`` as its bf16 forward weight ``low`` and int16 ``remainder`` (all contiguous)."""
    lower, upper = _halves(master)
    rem = remainder.view(-1)
    rem.copy_(lower)
    low.view(-1).view(torch.int16).copy_(forward_half(upper, rem))


def join_into(low: Tensor, remainder: Tensor, master: Tensor) -> None:
    """Write the exact FP32 master of bf16 ``low`` and int16 ``remainder`` into ``master`` (contiguous)."""
    lower, upper = _halves(master)
    rem = remainder.view(-1)
    lower.copy_(rem)
    upper.copy_(upper_half(low.reshape(-1).view(torch.int16), rem))


def joined(low: Tensor, remainder: Tensor) -> Tensor:
    """A new FP32 tensor: the exact master of ``low`` and ``remainder``."""
    out = torch.empty(low.shape, dtype=torch.float32, device=low.device)
    join_into(low.detach(), remainder, out)
    return out
