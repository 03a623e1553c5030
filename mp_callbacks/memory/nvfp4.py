"""Bytes of NVFP4 copies of tensors (what an NVFP4 recipe keeps from the forward for the backward).

One NVFP4 copy of a tensor (:mod:`mp_callbacks.fp8.nvfp4`) holds 4 bits per element (two E2M1
codes a byte), one E4M3 byte per block (``1 x block`` along the contraction axis, or
``block x block`` for a 2D weight; partial blocks count whole) and one float32 tensor scale (4
bytes; none for a single-level cast).  An NVFP4 recipe has no scaling state that persists between
steps (every scale comes from the current amax): its model state is ``bf16-master``'s.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..fp8 import NVFP4_BLOCK


def _ceil(n: int, b: int) -> int:
    return -(-int(n) // int(b))


def nvfp4_tensor_bytes(shape: Sequence[int], block: int = NVFP4_BLOCK, tile_2d: bool = False,
                       two_level: bool = True) -> int:
    """Bytes of one NVFP4 copy of a tensor of ``shape`` cast along its last axis: ``ceil(numel / 2)`` of codes,
    one byte per block (``tile_2d``: ``block x block`` over the last two axes) and 4 for the tensor scale."""
    dims = [int(d) for d in shape] or [1]
    numel = 1
    for d in dims:
        numel *= d
    rows = numel // dims[-1] if dims[-1] else 0
    if tile_2d and len(dims) >= 2:
        lead = rows // dims[-2] if dims[-2] else 0
        blocks = lead * _ceil(dims[-2], block) * _ceil(dims[-1], block)
    else:
        blocks = rows * _ceil(dims[-1], block)
    return _ceil(numel, 2) + blocks + (4 if two_level else 0)


def nvfp4_transient_bytes(weight_shape: Sequence[int], input_shape: Sequence[int], block: int = NVFP4_BLOCK,
                          weights_2d: bool = True, emulated: bool = True) -> dict[str, int]:
    """Bytes one NVFP4 Linear holds beyond the model state while it trains (activations, not model state).

    ``kept``: the NVFP4 copies kept from the forward for the backward: the weight cast along ``in`` and
    along ``out`` (2D blocks or 1 x ``block``), the input along ``in`` and along the tokens (the
    weight-gradient operand).  ``working``: what the emulation holds while a matmul runs, the float32
    dequantized operands of the weight and input (4 B/element); nothing more on FP4 hardware.
    """
    w = [int(d) for d in weight_shape]
    x = [int(d) for d in input_shape]
    tokens = 1
    for d in x[:-1]:
        tokens *= d
    kept = (nvfp4_tensor_bytes(w, block, weights_2d) + nvfp4_tensor_bytes(w[::-1], block, weights_2d)
            + nvfp4_tensor_bytes((tokens, x[-1]), block) + nvfp4_tensor_bytes((x[-1], tokens), block))
    numel = w[0] * w[1] + tokens * x[-1]
    return {"kept": kept, "working": 4 * numel if emulated else 0}
