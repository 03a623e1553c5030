"""Scaling out: DDP, FSDP2 and FSDP1 under the recipe; the gradient communication dtype and its counting.

The concept (the core's :mod:`mp_callbacks.memory`, sharding, and :mod:`mp_callbacks.fp8`, all-gather):
every rank takes the same skip decision (the overflow flag is all-reduced before it); gradients are reduced
in the recipe's ``comm_dtype``.  The rules here:

* DDP: the recipe's ``comm_dtype`` as a DDP communication hook (:func:`register_comm_hook`; under Fabric the
  wrapper is found by :class:`DDPWatch`); :class:`CommCounter` counts the bytes handed to collectives;
* FSDP2 (``ModelParallelStrategy``): the recipe as torch's ``MixedPrecisionPolicy`` (:func:`fsdp_policy`,
  :func:`fully_shard_model`); the sharded FP32 parameters are the masters; :class:`ShardedLayout` is what the
  plugin and the monitor read afterwards;
* FSDP1 (``FSDPStrategy``): :class:`FSDPMixedPrecision`, the recipe as that strategy's precision plugin.
"""

from .comm import (
           CommCounter,
           DDPWatch,
           cast_hook,
           comm_hook,
           count_fsdp_collectives,
           fsdp_comm_units,
           register_comm_hook,
)
from .fsdp import ShardedLayout, fsdp_policy, fully_shard_model, inspect_sharded, local, prepare_fp8_all_gather
from .fsdp1 import FSDPMixedPrecision

__all__ = ["CommCounter", "DDPWatch", "FSDPMixedPrecision", "ShardedLayout", "cast_hook", "comm_hook",
           "count_fsdp_collectives", "fsdp_comm_units", "fsdp_policy", "fully_shard_model", "inspect_sharded",
           "local", "prepare_fp8_all_gather", "register_comm_hook"]
