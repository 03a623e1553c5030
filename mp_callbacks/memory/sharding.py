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
* :func:`fsdp_step_bytes`: the payloads a sharded step hands to its
  collectives (FSDP2: one reduce-scatter of the gradients in ``reduce_dtype``
  per unit, one all-gather of the parameters in ``param_dtype`` per gather, FP8 weights in 1 byte
  under ``fsdp_float8_all_gather``), dim 0 of every parameter padded to a multiple of the shard count.
* :func:`consensus_cost`: the overflow consensus of loss-scaled recipes: one
  all-reduce (MAX) of one float32 flag per optimizer step, so every rank
  skips together.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from ..dtypes import canonical_dtype, dtype_bytes
from ..fp8.formats import FORMAT_ALIASES, FP8_FORMATS

__all__ = ["ShardedDtypes", "allreduce_bytes", "consensus_cost", "fsdp_step_bytes", "padded_numel", "sharded_dtypes"]


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


def padded_numel(shape: Sequence[int], world_size: int) -> int:
    """Elements of a parameter as sharded on dim 0 over ``world_size`` ranks: dim 0 padded up to a multiple
    of ``world_size`` (FSDP2's ``Shard(0)``; a 0-d tensor counts as one row)."""
    dims = [int(d) for d in shape] or [1]
    n = max(int(world_size), 1)
    rest = 1
    for d in dims[1:]:
        rest *= d
    return -(-dims[0] // n) * n * rest


def _wire(name: str, op: str) -> tuple[str, int]:
    """A gather/reduce dtype name as counted and its bytes: a float by its canonical name; an FP8 format
    travels as its bytes (``uint8``, 1 byte: any backend gathers bytes)."""
    if name in FP8_FORMATS or name in FORMAT_ALIASES:
        return "uint8", 1
    dtype = canonical_dtype(name, op)
    return dtype, dtype_bytes(dtype)


def fsdp_step_bytes(units: Iterable[tuple[Sequence[Sequence[int]], str | Sequence[str], str, int]],
                    world_size: int) -> dict[str, dict[str, int]]:
    """Payload bytes one optimizer step hands to a sharded model's collectives, by collective and dtype.

    ``units``: one ``(parameter shapes, gather dtype, reduce dtype, gathers per step)`` per sharded unit
    (a unit resharded after forward is gathered again for backward: 2; the root: 1).  Per step each unit
    reduce-scatters its padded gradients once in the reduce dtype and all-gathers its padded parameters
    once per gather in the gather dtype.  The gather dtype may be one per parameter (a weight gathered
    as ``float8_e4m3fn``: 1 byte, sent as ``uint8``, :mod:`mp_callbacks.fp8.allgather`); a unit whose
    parameters gather in different dtypes is one byte buffer, counted as ``uint8`` (as FSDP2 sends it).
    A payload is the whole (unsharded) buffer: each rank sends ``(N - 1) / N`` of it around a ring,
    half an all-reduce's ``2 (N - 1) / N``.
    Returns ``{"reduce_scatter": {dtype: bytes}, "all_gather": {dtype: bytes}}``.
    """
    out: dict[str, dict[str, int]] = {"reduce_scatter": {}, "all_gather": {}}
    for shapes, gather, reduce, gathers in units:
        numels = [padded_numel(s, world_size) for s in shapes]
        if not sum(numels):
            continue
        per_param = [gather] * len(numels) if isinstance(gather, str) else list(gather)
        if len(per_param) != len(numels):
            raise ValueError(f"{len(per_param)} gather dtypes for {len(numels)} parameters")
        wires = [_wire(name, "all_gather") for name in per_param]
        names = {w for w, _ in wires}
        gathered = sum(n * b for n, (_, b) in zip(numels, wires))
        red, red_bytes = _wire(reduce, "reduce_scatter")
        for op, dtype, size, times in (("reduce_scatter", red, sum(numels) * red_bytes, 1),
                                       ("all_gather", names.pop() if len(names) == 1 else "uint8", gathered,
                                        int(gathers))):
            if times:
                out[op][dtype] = out[op].get(dtype, 0) + times * size
    return out


def consensus_cost(world_size: int) -> dict[str, float]:
    """The per-step cost of the overflow consensus: one all-reduce (MAX) of one float32 value.

    Returns ``{"collectives": 1, "payload_bytes": 4, "ring_bytes_per_rank": 2 (N - 1) / N * 4}``.
    """
    n = max(int(world_size), 1)
    return {"collectives": 1, "payload_bytes": 4, "ring_bytes_per_rank": 2.0 * (n - 1) / n * 4}
