"""FP8 all-gather of sharded weights (torch FSDP2): the rule the adapter follows.

With ``fsdp_float8_all_gather=True`` (an :class:`~mp_callbacks.fp8.recipe.FP8Recipe` setting,
``fp8={"fsdp_float8_all_gather": True}``) a sharded data-parallel run all-gathers the weight of every
FP8 matmul the adapter can gather (:data:`FP8_GATHER_LAYERS`) as e4m3 bytes instead of its
low-precision copy: each rank casts its FP32 shard (the master) with the weight's one scale, the
all-gather moves 1 byte per element (bf16: 2), and the matmul uses the gathered FP8 weight and that
scale as they are (no second cast).  torchao's ``enable_fsdp_float8_all_gather`` does the same.

Every rank must cast with the same scale, the one the unsharded weight would get:

* ``mode="delayed"``: the committed state's scale (the same on every rank: the amaxes that made it
  were all-reduced at the last step).  No communication; the shard's amax is recorded, and the
  step's all-reduce (MAX) of every FP8 amax makes it the weight's.
* ``mode="current"``: the scale of this step's amax of the whole weight: each rank's shard amax,
  all-reduced (MAX) over the shard group before the cast (one float32 per weight per gather),
  then the current-scaling transition (:func:`~mp_callbacks.fp8.scaling.next_fp8_state`).

So the gathered e4m3 weight equals, bit for bit, the cast of the unsharded FP32 weight with that
scale (:func:`sharded_fp8_cast` is the NumPy reference).  It differs from the bf16-gather run's
cast, which rounds the FP32 master to bf16 first (two roundings): training agrees within FP8's
precision, not bit for bit.  Rows FSDP2 pads (dim 0 not a multiple of the shard count) are zeros,
which never change an amax.

Only ``tensorwise``: a row, block or MX scale along ``in`` is local to a shard, but the backward's
column-wise copy (scales along ``out``) spans the shards (torchao refuses it too).  Keras has no
FSDP2 (``tf.distribute`` replicates or shards variables without a gather extension): the Keras
adapter refuses the setting.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .config import FP8ScalingConfig
from .formats import FP8ConfigError, fp8_round
from .scaling import FP8State, initial_fp8_state, next_fp8_state

__all__ = ["FP8_GATHER_LAYERS", "FP8_GATHER_ROLE", "check_fp8_all_gather", "gather_reduces_amax",
           "sharded_fp8_cast"]

FP8_GATHER_ROLE = "weights"
"""The tensor role gathered in FP8 (the matmul's weight; inputs and gradients are not sharded)."""

FP8_GATHER_LAYERS: dict[str, tuple[str, ...]] = {"lightning": ("Linear",)}
"""The FP8 layers whose weights an adapter gathers in FP8, by framework.  ``MultiheadAttention``'s
projections (packed ``in_proj_weight``, sliced per projection) still gather in the compute dtype."""


def check_fp8_all_gather(enabled: Any, granularity: Any) -> None:
    """Raise :class:`FP8ConfigError` unless ``enabled`` is a bool, and ``tensorwise`` when it is True."""
    if not isinstance(enabled, bool):
        raise FP8ConfigError(f"fsdp_float8_all_gather={enabled!r} must be True or False")
    kind = getattr(granularity, "kind", granularity)
    if enabled and kind != "tensorwise":
        raise FP8ConfigError(
            f"fsdp_float8_all_gather=True gathers one scale per weight (granularity 'tensorwise'), not "
            f"{kind!r}: a {kind} weight is cast along both axes, and the backward's column-wise copy spans "
            "the shards. Use granularity 'tensorwise' with it, or gather in bf16 (the default)")


def gather_reduces_amax(config: FP8ScalingConfig) -> bool:
    """Whether a gather needs the weight's global amax before its cast (all-reduce MAX over the shards):
    current scaling does; delayed scaling casts with the committed scale."""
    return config.mode == "current"


def sharded_fp8_cast(shards: Sequence[Any], config: FP8ScalingConfig,
                     state: FP8State | None = None) -> tuple[list[np.ndarray], np.float32, np.float32]:
    """The NumPy reference of one weight's FP8 all-gather: ``(q per shard, scale, scale_inv)``.

    ``shards``: the FP32 rows each rank holds (dim 0 split).  The scale: ``state``'s under delayed
    scaling; under current scaling the transition of ``state`` with the max of the shards' amaxes
    (their all-reduce).  ``q``: each shard's saturating cast ``fp8(shard * scale)`` as float32
    values, so ``np.concatenate(q)`` is the cast of the whole weight.
    """
    arrays = [np.asarray(s, np.float32) for s in shards]
    state = initial_fp8_state(config) if state is None else state
    if gather_reduces_amax(config):
        amaxes = [np.float32(np.abs(a).max()) if a.size else np.float32(0.0) for a in arrays]
        state, _ = next_fp8_state(config, state, np.max(np.asarray(amaxes, np.float32)))
    scale, scale_inv = np.float32(state.scale), np.float32(state.scale_inv)
    with np.errstate(over="ignore", under="ignore", invalid="ignore"):
        if config.stored == "scale_inv":
            q = [fp8_round(a / scale_inv, config.fmt, saturate=True) for a in arrays]
        else:
            q = [fp8_round(a * scale, config.fmt, saturate=True) for a in arrays]
    return q, scale, scale_inv
