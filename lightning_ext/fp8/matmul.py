"""The FP8 matmul of ``fp8-mixed`` in torch: an ``autograd.Function`` over :class:`lightning_ext.fp8.TorchFP8`.

``y = qdq(x) @ qdq(W)^T + b`` with e4m3 inputs and weights in the forward
pass and the e5m2 output gradient in the backward pass
(:mod:`mp_callbacks.fp8.recipe`): the FP8 operands are kept for the backward
(1 byte per element, as on FP8 hardware), the matmul runs in float32 on the
dequantized values, the output in the autocast dtype.  On a CUDA device with
FP8 tensor cores the forward matmul is ``torch._scaled_mm`` (gated by
:func:`_scaled_mm_ok`; not tested here, no such device).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from mp_callbacks.fp8 import FP8Granularity

from .allgather import gathered_parts


class Quantizer(Protocol):
    """What the matmul needs of the FP8 state (:class:`lightning_ext.fp8.TorchFP8` is one)."""

    granularity: FP8Granularity

    def quantize(self, role: str, index: int, x: Tensor, record: bool, axis: int = -1) -> tuple[Tensor, Tensor]:
        """``(x cast to FP8 with role's scale, scale_inv)`` for matmul ``index`` along the contraction
        ``axis``; ``record``: keep its amax."""
        ...


def _scaled_mm_ok(x: Tensor, weight: Tensor) -> bool:
    """The gated FP8 tensor-core path: CUDA, compute capability >= 8.9, dims multiples of 16."""
    if x.device.type != "cuda" or not hasattr(torch, "_scaled_mm"):
        return False
    if torch.cuda.get_device_capability(x.device) < (8, 9):
        return False
    return x.shape[-1] % 16 == 0 and weight.shape[0] % 16 == 0


class _FP8Matmul(torch.autograd.Function):
    """``y = qdq(x) @ qdq(W)^T + b`` in float32, cast to ``out_dtype``; backward with ``qdq(dy)`` (e5m2).

    The FP8 operands (not dequantized copies) are kept for the backward, as on FP8 hardware.  With
    per-tensor scales one FP8 copy of each operand serves every matmul.  With rowwise, blockwise or
    MX scales each matmul casts its operands along its own contraction axis (as torchao and
    Transformer Engine do): ``x`` and ``W`` along ``in`` for the output, ``W`` along ``out`` for
    ``dx = qdq(dy) @ qdq(W)``, ``x`` and ``dy`` along the tokens for ``dW = qdq(dy)^T qdq(x)``; the
    forward keeps those column-wise FP8 copies for the backward.  ``weight_grad_hp`` keeps ``dW``
    in high precision (torchao's ``rowwise_with_gw_hp``): ``dW = dy^T x``.
    """

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, bias: Tensor | None, fp8: Quantizer, index: int,
                out_dtype: torch.dtype, record: bool) -> Tensor:
        granularity = fp8.granularity
        with torch.autocast(x.device.type, enabled=False):
            xq, x_inv = fp8.quantize("inputs", index, x, record)
            gathered = gathered_parts(weight)  # FSDP2 gathered it in FP8 (its amax recorded at the gather)
            wq, w_inv = gathered if gathered is not None else fp8.quantize("weights", index, weight, record)
            b32 = None if bias is None else bias.float()
            kind = granularity.kind
            if kind in ("tensorwise", "rowwise") and _scaled_mm_ok(x, weight):  # untested here: FP8 tensor cores
                rows = kind == "rowwise"
                out = torch._scaled_mm(xq.reshape(-1, xq.shape[-1]), wq.t(),
                                       scale_a=x_inv.reshape(-1, 1) if rows else x_inv.reshape(()),
                                       scale_b=w_inv.reshape(1, -1) if rows else w_inv.reshape(()),
                                       out_dtype=torch.bfloat16 if rows else torch.float32).float()
                out = (out if b32 is None else out + b32).reshape(*x.shape[:-1], weight.shape[0])
            else:
                out = F.linear(xq.float() * x_inv, wq.float() * w_inv, b32)
            if kind == "tensorwise":
                saved = (xq, x_inv, wq, w_inv)
            else:  # column-wise copies for the backward's two matmuls
                x2 = x.reshape(-1, x.shape[-1])
                wc, wc_inv = fp8.quantize("weights", index, weight, False, axis=0)
                if granularity.weight_grad_hp:
                    xc, xc_inv = x2.detach(), torch.ones((), device=x.device)
                else:
                    xc, xc_inv = fp8.quantize("inputs", index, x2, False, axis=0)
                saved = (xc, xc_inv, wc, wc_inv)
        ctx.save_for_backward(*saved)
        ctx.fp8, ctx.index, ctx.has_bias = fp8, index, bias is not None
        ctx.dtypes = (x.dtype, weight.dtype, None if bias is None else bias.dtype)
        return out.to(out_dtype)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        xq, x_inv, wq, w_inv = ctx.saved_tensors
        x_dtype, w_dtype, b_dtype = ctx.dtypes
        granularity = ctx.fp8.granularity
        with torch.autocast(grad.device.type, enabled=False):
            g32 = grad.float()
            gq, g_inv = ctx.fp8.quantize("grad_outputs", ctx.index, g32, True)
            g = gq.float() * g_inv
            w = wq.float() * w_inv
            dx = dw = db = None
            if ctx.needs_input_grad[0]:
                dx = (g @ w).to(x_dtype)
            if ctx.needs_input_grad[1]:
                x = xq.float() * x_inv
                g2 = g32.reshape(-1, g32.shape[-1])
                if granularity.kind == "tensorwise":
                    g2 = g.reshape(-1, g.shape[-1])
                elif not granularity.weight_grad_hp:
                    gc, gc_inv = ctx.fp8.quantize("grad_outputs", ctx.index, g2, False, axis=0)
                    g2 = gc.float() * gc_inv
                dw = (g2.t() @ x.reshape(-1, x.shape[-1])).to(w_dtype)
            if ctx.has_bias and ctx.needs_input_grad[2]:
                db = g32.reshape(-1, g32.shape[-1]).sum(0).to(b_dtype)
        return dx, dw, db, None, None, None, None


def fp8_linear(x: Tensor, weight: Tensor, bias: Tensor | None, fp8: Quantizer, index: int) -> Tensor:
    """The FP8 matmul of entry ``index`` of ``fp8``; under autocast the input is first cast to the
    autocast dtype and the output is in it (else in ``x``'s dtype).

    Amaxes are recorded while grad is enabled (a training step), not in evaluation passes."""
    device = x.device.type
    out_dtype = x.dtype
    if torch.is_autocast_enabled(device):  # the input in the compute dtype, as autocast gives a Linear (and Keras)
        out_dtype = torch.get_autocast_dtype(device)
        x = x.to(out_dtype) if x.is_floating_point() else x
    return _FP8Matmul.apply(x, weight, bias, fp8, index, out_dtype, torch.is_grad_enabled())
