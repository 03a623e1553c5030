"""``nn.MultiheadAttention`` with FP8 in/out projections (``fp8-mixed``).

Torch's ``MultiheadAttention`` does not call its projections as modules (it
hands their weights to ``F.multi_head_attention_forward``), so under
``fp8-mixed`` its ``forward`` is replaced by :func:`mha_forward`: the same
computation (checked against torch's module in the tests) with each
projection an FP8 matmul:

* ``in_proj``: the packed q/k/v projection when ``query is key is value``
  (self-attention: one matmul, one weight scale for the packed weight);
* ``q_proj`` / ``k_proj`` / ``v_proj``: the three projections when the inputs
  differ or the module keeps separate weights (``kdim``/``vdim``);
* ``out_proj``: the output projection.

The attention itself (``softmax(q k^T / sqrt(d)) v``) is not an FP8 matmul:
it runs as ``F.scaled_dot_product_attention`` in the autocast dtype, or, when
the weights are asked for (``need_weights=True``), explicitly with the
softmax in FP32.  Modules with ``add_bias_kv`` or ``add_zero_attn`` keep
torch's own forward (no FP8), as the FP8 path does not reproduce them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def mha_matmuls(module: nn.MultiheadAttention) -> list[str]:
    """The FP8 matmuls of ``module``, by name (see the module docstring)."""
    if module.bias_k is not None or module.add_zero_attn:
        return []
    inputs = ["in_proj", "q_proj", "k_proj", "v_proj"] if module._qkv_same_embed_dim else ["q_proj", "k_proj",
                                                                                          "v_proj"]
    return inputs + ["out_proj"]


def _float_mask(mask: Tensor | None, like: Tensor) -> Tensor | None:
    """A boolean mask (True: not allowed) as an additive float mask; a float mask as is."""
    if mask is None:
        return None
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=like.dtype, device=like.device).masked_fill(mask, float("-inf"))
    return mask.to(like.dtype)


def _merged_mask(attn_mask: Tensor | None, key_padding_mask: Tensor | None, n: int, heads: int,
                 length: int, source: int, like: Tensor) -> Tensor | None:
    """``attn_mask`` ((L, S) or (N*H, L, S)) and ``key_padding_mask`` ((N, S)) as one additive
    (N or 1, H or 1, L, S) mask."""
    out = None
    am = _float_mask(attn_mask, like)
    if am is not None:
        out = am.reshape(1, 1, length, source) if am.dim() == 2 else am.reshape(n, heads, length, source)
    kpm = _float_mask(key_padding_mask, like)
    if kpm is not None:
        kpm = kpm.reshape(n, 1, 1, source)
        out = kpm if out is None else out + kpm
    return out


def mha_forward(module: nn.MultiheadAttention, matmul: Callable[[str, Tensor, Tensor, Tensor | None], Tensor],
                own_forward: Callable[..., Any], query: Tensor, key: Tensor, value: Tensor,
                key_padding_mask: Tensor | None = None, need_weights: bool = True,
                attn_mask: Tensor | None = None, average_attn_weights: bool = True,
                is_causal: bool = False) -> tuple[Tensor, Tensor | None]:
    """``module(query, key, value, ...)`` with the projections computed by ``matmul(name, x, W, b)``.

    Arguments and results are those of ``nn.MultiheadAttention.forward``
    (``is_causal`` is a hint there: ``attn_mask`` is what is applied).
    """
    if not mha_matmuls(module):
        return own_forward(query, key, value, key_padding_mask=key_padding_mask, need_weights=need_weights,
                           attn_mask=attn_mask, average_attn_weights=average_attn_weights, is_causal=is_causal)
    if is_causal and attn_mask is None:
        raise RuntimeError("Need attn_mask if specifying the is_causal hint (as torch's MultiheadAttention)")
    self_attention = query is key and key is value
    batched = query.dim() == 3
    if not batched:
        query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
        if key_padding_mask is not None:
            key_padding_mask = key_padding_mask.unsqueeze(0)
    elif module.batch_first:
        query, key, value = query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1)
    # (L, N, E) from here, as torch's functional form
    length, n, embed = query.shape
    source = key.shape[0]
    heads, head_dim = module.num_heads, module.head_dim
    if module._qkv_same_embed_dim:
        bias = module.in_proj_bias
        if self_attention:
            q, k, v = matmul("in_proj", query, module.in_proj_weight, bias).chunk(3, dim=-1)
        else:
            w_q, w_k, w_v = module.in_proj_weight.chunk(3)
            b_q, b_k, b_v = bias.chunk(3) if bias is not None else (None, None, None)
            q, k, v = (matmul("q_proj", query, w_q, b_q), matmul("k_proj", key, w_k, b_k),
                       matmul("v_proj", value, w_v, b_v))
    else:
        bias = module.in_proj_bias
        b_q, b_k, b_v = bias.chunk(3) if bias is not None else (None, None, None)
        q = matmul("q_proj", query, module.q_proj_weight, b_q)
        k = matmul("k_proj", key, module.k_proj_weight, b_k)
        v = matmul("v_proj", value, module.v_proj_weight, b_v)

    def heads_first(t: Tensor, steps: int) -> Tensor:  # (steps, N, E) -> (N, H, steps, d)
        return t.reshape(steps, n, heads, head_dim).permute(1, 2, 0, 3)

    q, k, v = heads_first(q, length), heads_first(k, source), heads_first(v, source)
    mask = _merged_mask(attn_mask, key_padding_mask, n, heads, length, source, q if q.is_floating_point() else query)
    dropout = module.dropout if module.training else 0.0
    weights = None
    if need_weights:
        scores = (q.float() @ k.float().transpose(-2, -1)) / math.sqrt(head_dim)
        if mask is not None:
            scores = scores + mask.float()
        weights = torch.softmax(scores, dim=-1)
        attn = F.dropout(weights, p=dropout, training=dropout > 0).to(v.dtype) @ v
    else:
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=None if mask is None else mask.to(q.dtype),
                                              dropout_p=dropout)
    attn = attn.permute(2, 0, 1, 3).reshape(length, n, embed)
    out = matmul("out_proj", attn, module.out_proj.weight, module.out_proj.bias)
    if weights is not None and average_attn_weights:
        weights = weights.mean(dim=1)
    if not batched:
        out = out.squeeze(1)
        if weights is not None:
            weights = weights.squeeze(0)
    elif module.batch_first:
        out = out.transpose(0, 1)
    return out, weights
