"""What the policy decided per layer (:func:`policy_report`) and how much of the model's matmul work runs in
low precision (:func:`low_precision_share`)."""

from __future__ import annotations

from typing import Any

import keras

from ..global_policy import core_policy
from ..layers import own_variables, walk
from .casts import compute_dtype
from .plan import MATMUL_LAYERS, make_plan

__all__ = ["MATMUL_LAYERS", "low_precision_share", "matmul_layers", "policy_report"]

def policy_report(model: keras.Model, policy: Any = None) -> list[dict[str, str]]:
    """What the policy decides for every layer of ``model``: ``{"path", "class", "compute", "storage", "why"}``.

    The rows of the Lightning adapter's ``policy_report`` (format them with
    :func:`mp_callbacks.policy.format_report`): ``compute`` is the dtype the
    policy gives the layer (``policy``: anything :func:`keras_ext.resolve_policy` takes;
    default: the global one, as :func:`keras_ext.apply_policy`), ``storage`` the dtype of
    the floating variables it owns (``"-"`` when none), ``why`` the rule that
    decided (and the cast of its outputs where it meets its composite), and, when the
    layer computes in another dtype (the policy was not applied to it), which.
    A subclassed model is a composite: its own row has path ``""``.
    """
    rows = []
    for row in make_plan(model, core_policy(policy)):
        own = [keras.backend.standardize_dtype(v.dtype) for v in own_variables(row.layer)
               if keras.backend.is_float_dtype(keras.backend.standardize_dtype(v.dtype))]
        why, actual = row.why, compute_dtype(row.layer)
        if actual != row.compute:
            why += f"; the layer computes in {actual} (keras_ext.apply_policy was not applied to it)"
        rows.append({"path": row.path, "class": type(row.layer).__name__, "compute": row.compute,
                     "storage": own[0] if own else "-", "why": why})
    return rows


def matmul_layers(model: Any) -> list[tuple[str, Any]]:
    """``(path, layer)`` of the Dense/EinsumDense/Conv layers of ``model`` that are built."""
    return [(p, x) for p, x in walk(model) if isinstance(x, MATMUL_LAYERS) and getattr(x, "built", False)]


def low_precision_share(model: Any, paths: bool = False) -> Any:
    """The fraction of ``model``'s matmul work that runs below FP32: kernel parameters of the
    Dense/EinsumDense/Conv layers whose compute dtype is float16/bfloat16, over all of them (a kernel's
    size is its matmul's multiply-adds per output position).  ``paths=True``: also the low and FP32 paths."""
    low, high, total, low_size = [], [], 0, 0
    for path, layer in matmul_layers(model):
        size = int(sum(_size(v) for v in own_variables(layer) if v.path.endswith("kernel")))
        total += size
        if compute_dtype(layer) in ("float16", "bfloat16"):
            low_size += size
            low.append(path)
        else:
            high.append(path)
    share = low_size / total if total else 0.0
    return (share, low, high) if paths else share


def _size(v: Any) -> int:
    n = 1
    for d in v.shape:
        n *= int(d)
    return n
