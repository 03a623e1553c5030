"""The core's FP8 granularities in torch: rowwise, blockwise and MXFP8 casts with current scales.

The rule of each kind is :mod:`mp_callbacks.fp8.granularity` (whose NumPy reference
:func:`~mp_callbacks.fp8.quantize` this equals bit for bit, and through it torchao's
casts): the amax of every block along the matmul's contraction axis, its scale (float64 then
float32, power-of-two rounding down where the kind asks; MX: the E8M0 exponent by ``floor`` or
``rceil``), the saturating cast to the FP8 dtype.  :func:`block_cast` returns the FP8 tensor and
the float32 factor that dequantizes it, broadcastable to the tensor (one value per row for
``rowwise``; expanded to the tensor's shape for the block kinds), so the matmul reads
``q.float() * inv`` whatever the granularity.
"""

from __future__ import annotations

import torch
from torch import Tensor

from mp_callbacks.fp8 import AMAX_EPSILON, E8M0_BIAS, E8M0_NAN, FP8Granularity, block_shape


def _sizes(shape: torch.Size, blocks: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(n if b == 0 else min(b, n) if n else 1 for n, b in zip(shape, blocks))


def _block_amax(x: Tensor, sizes: tuple[int, ...]) -> Tensor:
    """max |x| of every block (zero padding to whole blocks; NaN propagates), one value per block."""
    pad: list[int] = []
    for n, b in reversed(list(zip(x.shape, sizes))):
        pad += [0, (-n) % b]
    a = torch.nn.functional.pad(x.abs(), pad) if any(pad) else x.abs()
    view: list[int] = []
    for n, b in zip(a.shape, sizes):
        view += [n // b, b]
    blocked = a.reshape(view)
    return blocked.amax(dim=tuple(range(1, blocked.dim(), 2))) if blocked.numel() else blocked.sum(
        dim=tuple(range(1, blocked.dim(), 2)))


def _expand(values: Tensor, sizes: tuple[int, ...], shape: torch.Size) -> Tensor:
    for dim, b in enumerate(sizes):
        if b > 1:
            values = values.repeat_interleave(b, dim=dim)
    return values[tuple(slice(0, n) for n in shape)]


def _mx(amax: Tensor, fmax: float, rounding: str) -> tuple[Tensor, Tensor]:
    """``(biased E8M0 exponent as uint8, the factor a block's data is multiplied by)``."""
    if rounding == "rceil":
        descale = amax / fmax
        exp = torch.clamp(torch.ceil(torch.log2(descale)), -E8M0_BIAS, E8M0_BIAS) + E8M0_BIAS
        exp = torch.where(torch.isinf(descale), 254.0, torch.where(torch.isnan(descale), float(E8M0_NAN),
                                                                     torch.nan_to_num(exp)))
        e = exp.to(torch.uint8)
        rcp = torch.where(e == 0, torch.ones_like(amax), torch.exp2(E8M0_BIAS - e.float()))
        rcp = torch.where(e == 254, torch.full_like(amax, 2.0**-127), rcp)
        return e, torch.where(torch.isnan(descale), descale, rcp)
    emax = int(torch.floor(torch.log2(torch.tensor(fmax))).item())  # 8 (e4m3), 15 (e5m2)
    pow2 = ((amax.view(torch.int32) >> 23) & 0xFF) - E8M0_BIAS
    exp = torch.clamp(pow2 - emax, -E8M0_BIAS, E8M0_BIAS + 1) + E8M0_BIAS
    e = torch.where(torch.isnan(amax), E8M0_NAN, exp).to(torch.uint8)
    scale = (e.to(torch.int32) << 23).view(torch.float32).clamp(min=2.0**-126)
    return e, 1.0 / scale


def block_cast(x: Tensor, granularity: FP8Granularity, dtype: torch.dtype, *, axis: int = -1,
               weight: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """``(q, inv, scales)``: ``x`` cast to the FP8 ``dtype`` at ``granularity`` (not ``tensorwise``) along
    the contraction ``axis``; ``inv`` dequantizes (``q.float() * inv``, broadcastable to ``x``);
    ``scales``: one per block (float32 multipliers, MX uint8 exponents), as the core returns them."""
    fmax = torch.finfo(dtype).max
    moved = x.detach().float().movedim(axis, -1) if x.dim() else x.detach().float().reshape(1)
    kind = granularity.kind
    sizes = _sizes(moved.shape, block_shape(kind, moved.dim(), weight=weight, block=granularity.block,
                                             mx_block=granularity.mx_block))
    amax = _block_amax(moved, sizes).float()
    if kind == "mxfp8":
        scales, factor = _mx(amax, fmax, granularity.mx_rounding)
        inv = torch.where(scales == E8M0_NAN, torch.full_like(amax, float("nan")),
                          torch.exp2(scales.float() - E8M0_BIAS))
    else:
        scale = (fmax / torch.clamp(amax.double(), min=AMAX_EPSILON)).float()
        if granularity.rounds_to_pow2:
            scale = torch.exp2(torch.floor(torch.log2(scale)))
        scales, factor, inv = scale, scale, 1.0 / scale
    q = (moved * _expand(factor, sizes, moved.shape)).clamp(-fmax, fmax).to(dtype)
    inv = inv if kind == "rowwise" else _expand(inv, sizes, moved.shape)
    if x.dim() == 0:
        return q.reshape(()), inv.reshape(()), scales.reshape(())
    return q.movedim(-1, axis), inv.movedim(-1, axis), scales.movedim(-1, axis)
