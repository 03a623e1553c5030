"""Scaling out: what a recipe means across ranks (no framework imports).

Three rules the adapters translate:

* :func:`sharded_dtypes`: a recipe as a sharded-data-parallel mixed-precision
  policy (torch FSDP2's ``MixedPrecisionPolicy(param_dtype, reduce_dtype,
  output_dtype)``, FSDP1's ``MixedPrecision``).  Parameters are kept as FP32
  shards in every recipe; under ``*-master`` those shards ARE the masters
  (no second copy) and the all-gather casts them to the low-precision
  ``param_dtype`` for compute.  ``*-mixed`` gathers FP32 and computes under
  autocast, as on one device.  Gradients are reduced in the recipe's
  ``comm_dtype``.  Modules the policy keeps in FP32 gather FP32.
* :func:`allreduce_bytes`: the payload of one data-parallel gradient
  all-reduce in ``comm_dtype`` (what a counting hook should see).
* :func:`consensus_cost`: the overflow consensus of loss-scaled recipes: one
  all-reduce (MAX) of one float32 flag per optimizer step, so every rank
  skips together.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

from .dtypes import canonical_dtype, dtype_bytes

__all__ = ["ShardedDtypes", "allreduce_bytes", "consensus_cost", "sharded_dtypes"]


@dataclass(frozen=True)
class ShardedDtypes:
    """Dtype names of a sharded mixed-precision policy (None: leave that tensor's dtype alone).

    ``param_dtype``: the dtype parameters are all-gathered (and computed) in;
    ``reduce_dtype``: the dtype gradients are reduced in; ``output_dtype``:
    the dtype of the sharded root's forward outputs.
    """

    param_dtype: str | None
    reduce_dtype: str | None
    output_dtype: str | None

    def to_dict(self) -> dict[str, Any]:
        """Plain data."""
        return {"param_dtype": self.param_dtype, "reduce_dtype": self.reduce_dtype,
                "output_dtype": self.output_dtype}


def sharded_dtypes(recipe: Any, keeps_fp32: bool = False, root: bool = True) -> ShardedDtypes:
    """The sharded policy of ``recipe`` (a :class:`~mp_callbacks.recipes.Recipe`).

    ==============  ============  ==============  ==============
    recipe          param_dtype   reduce_dtype    output_dtype
    ==============  ============  ==============  ==============
    ``32-true``     None (fp32)   comm_dtype      None
    ``*-mixed``     None (fp32)   comm_dtype      None (autocast decides)
    ``*-master``    fp16 / bf16   comm_dtype      policy output (float32)
    ==============  ============  ==============  ==============

    ``keeps_fp32``: the module is one the policy keeps in FP32 (norms,
    losses...): its parameters gather in FP32 (``param_dtype`` None) under
    every recipe.  ``root=False``: an inner sharded unit, whose outputs stay
    in the compute dtype (``output_dtype`` None; only the root's are cast).
    ``bf16-kahan`` / ``bf16-sr`` keep low-precision weights without masters,
    which sharding does not: a ``ValueError`` says to use ``bf16-master``.
    """
    plan = recipe.master
    if plan.rounds_updates:
        raise ValueError(f"recipe {recipe.name!r} keeps bf16 weights without masters; sharded training keeps FP32 "
                         "shards, so it has no sharded form. Use 'bf16-master' (the FP32 shards are the masters)")
    reduce = canonical_dtype(getattr(recipe, "comm_dtype", "float32"), "comm_dtype")
    if plan.master_weights and not keeps_fp32:
        output = canonical_dtype(recipe.policy.output, "output") if root else None
        return ShardedDtypes(plan.param_dtype, reduce, output)
    return ShardedDtypes(None, reduce, None)


def allreduce_bytes(numels: Iterable[int] | int, comm_dtype: str) -> int:
    """Payload bytes of one gradient all-reduce of ``numels`` elements in ``comm_dtype``
    (what each rank hands to the collective per step; a ring all-reduce moves ``2 (N - 1) / N`` of it)."""
    total = numels if isinstance(numels, int) else sum(int(n) for n in numels)
    return int(total) * dtype_bytes(comm_dtype)


def consensus_cost(world_size: int) -> dict[str, float]:
    """The per-step cost of the overflow consensus: one all-reduce (MAX) of one float32 value.

    Returns ``{"collectives": 1, "payload_bytes": 4, "ring_bytes_per_rank": 2 (N - 1) / N * 4}``.
    """
    n = max(int(world_size), 1)
    return {"collectives": 1, "payload_bytes": 4, "ring_bytes_per_rank": 2.0 * (n - 1) / n * 4}
