"""Scaling-out rules of the core: comm_dtype in the recipe, the sharded dtype policy, per-rank bytes.

Expected values are written out by hand (FP32 shard = 4 bytes per element, AdamW = 2 FP32 slots), never
taken from another call of the code under test.
"""

from __future__ import annotations

import pytest

from mp_callbacks import estimate_memory, get_recipe
from mp_callbacks.memory import (
    ShardedDtypes,
    allreduce_bytes,
    bytes_per_param,
    consensus_cost,
    fsdp_step_bytes,
    padded_numel,
    sharded_dtypes,
)
from mp_callbacks.recipes import COMM_DTYPES, Recipe, RecipeError


@pytest.mark.parametrize("comm", COMM_DTYPES)
def test_comm_dtype_is_one_recipe_setting_that_round_trips(comm):
    recipe = get_recipe("16-mixed", comm_dtype=comm)
    assert recipe.comm_dtype == comm
    assert Recipe.from_dict(recipe.to_dict()) == recipe
    assert get_recipe("bf16-master").comm_dtype == "float32"  # the default: FP32 reduction, as native DDP/FSDP


def test_comm_dtype_aliases_and_errors():
    assert get_recipe("bf16-mixed", comm_dtype="bf16").comm_dtype == "bfloat16"
    assert get_recipe("32-true").with_comm_dtype("fp16").comm_dtype == "float16"
    with pytest.raises(RecipeError, match="comm_dtype='int8'.*float32, float16, bfloat16"):
        get_recipe("16-mixed", comm_dtype="int8")
    old = get_recipe("16-mixed").to_dict()
    del old["comm_dtype"]  # a recipe record written before the setting existed
    assert Recipe.from_dict(old).comm_dtype == "float32"


@pytest.mark.parametrize("name, param, output", [
    ("32-true", None, None), ("16-mixed", None, None), ("bf16-mixed", None, None),
    ("16-master", "float16", "float32"), ("bf16-master", "bfloat16", "float32"),
])
@pytest.mark.parametrize("comm", COMM_DTYPES)
def test_sharded_dtypes_of_each_recipe(name, param, output, comm):
    recipe = get_recipe(name, comm_dtype=comm)
    assert sharded_dtypes(recipe) == ShardedDtypes(param, comm, output)
    # a module the policy keeps in FP32 (a norm) gathers its FP32 shards as they are
    assert sharded_dtypes(recipe, keeps_fp32=True) == ShardedDtypes(None, comm, None)
    # an inner unit: outputs stay in the compute dtype, only the root casts them
    assert sharded_dtypes(recipe, root=False) == ShardedDtypes(param, comm, None)


@pytest.mark.parametrize("name", ["bf16-kahan", "bf16-sr"])
def test_update_rounding_recipes_have_no_sharded_form(name):
    with pytest.raises(ValueError, match="bf16-master"):
        sharded_dtypes(get_recipe(name))
    with pytest.raises(ValueError, match="\\*-master"):
        estimate_memory(get_recipe(name).master, "adamw", 8, n_shards=2)


@pytest.mark.parametrize("name", ["32-true", "16-mixed", "bf16-mixed", "16-master", "bf16-master"])
@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_per_rank_bytes_per_param_with_adamw(name, n):
    # one rank: FP32 param shard (4) + FP32 grad shard (4) + m, v shards (4 + 4), each 1/n of the model
    assert bytes_per_param(get_recipe(name).master, "adamw", n_shards=n) == 16 / n


def test_sharded_estimate_splits_masters_from_weights():
    plan = get_recipe("bf16-master").master
    # 64 bf16-stored elements (their FP32 shards are the masters) + 16 FP32-kept (a norm), 2 shards
    est = estimate_memory(plan, "adamw", [(64, "bfloat16"), (16, "float32")], n_shards=2)
    assert (est.params, est.masters, est.weights) == (80, 32 * 4, 8 * 4)
    assert (est.grads, est.optimizer_state, est.compensation) == (40 * 4, 40 * 8, 0)
    assert est.bytes_per_param == (40 * 16) / 80
    # SGD without momentum: no state; an odd size rounds up per tensor (the largest shard)
    sgd = estimate_memory(get_recipe("16-mixed").master, "sgd", [(5, "float32")], n_shards=2)
    assert (sgd.weights, sgd.grads, sgd.optimizer_state) == (3 * 4, 3 * 4, 0)
    with pytest.raises(ValueError, match="n_shards must be at least 1"):
        estimate_memory(plan, "adamw", 8, n_shards=0)


def test_allreduce_payload_and_consensus_cost():
    assert allreduce_bytes([10, 6], "float32") == 64
    assert allreduce_bytes(16, "bfloat16") == allreduce_bytes(16, "float16") == 32
    assert consensus_cost(2) == {"collectives": 1, "payload_bytes": 4, "ring_bytes_per_rank": 4.0}
    assert consensus_cost(8)["ring_bytes_per_rank"] == 2 * 7 / 8 * 4


def test_padded_numel_rounds_dim0_up_to_the_shard_count():
    # FSDP2's Shard(0): dim 0 padded to a multiple of the world size, other dims whole
    assert padded_numel((16, 8), 2) == 128
    assert padded_numel((15, 8), 2) == 16 * 8
    assert padded_numel((3,), 4) == 4
    assert padded_numel((5, 2, 3), 1) == 30
    assert padded_numel((), 2) == 2  # a 0-d tensor is one row


def test_fsdp_step_bytes_by_collective_and_dtype():
    # a Linear(8, 15) unit gathered in bf16 twice a step (resharded after forward), reduced in fp32;
    # the root holds a Linear(15, 1) gathered once in fp32, reduced in fp32
    units = [([(15, 8), (15,)], "bfloat16", "float32", 2), ([(1, 15), (1,)], "float32", "float32", 1)]
    got = fsdp_step_bytes(units, world_size=2)
    leaf, root = 16 * 8 + 16, 2 * 15 + 2  # padded elements
    assert got == {"reduce_scatter": {"float32": 4 * (leaf + root)},
                   "all_gather": {"bfloat16": 2 * 2 * leaf, "float32": 4 * root}}
    halved = fsdp_step_bytes([(s, g, "bf16", n) for s, g, _, n in units], world_size=2)
    assert halved["reduce_scatter"] == {"bfloat16": 2 * (leaf + root)}
    assert fsdp_step_bytes([([], "float32", "float32", 1)], 2) == {"reduce_scatter": {}, "all_gather": {}}
