"""Single-process checks of the scale-out configuration: FSDP2 policies, the FSDP1 precision class, DDP hooks.

Expected dtypes are written out per recipe (the table of mp_callbacks.memory.sharding), not read from the core.
The training paths run on two processes in test_scale_out.py.
"""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch.plugins.precision import FSDPPrecision
from lightning.pytorch.strategies import FSDPStrategy
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from lightning_ext import MixedPrecision, TorchLossScaler
from lightning_ext.distributed import FSDPMixedPrecision, comm_hook, register_comm_hook
from mp_callbacks.settings import StateDictError

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
# recipe -> (param_dtype, output_dtype) of the root; reduce_dtype is comm_dtype
ROOT = {"32-true": (None, None), "16-mixed": (None, None), "bf16-mixed": (None, None),
        "16-master": (FP16, FP32), "bf16-master": (BF16, FP32)}
COMM = {"float32": FP32, "bfloat16": BF16, "float16": FP16}


@pytest.mark.parametrize("recipe", list(ROOT))
@pytest.mark.parametrize("comm", list(COMM))
def test_fsdp_policy_of_each_recipe(recipe, comm):
    plugin = MixedPrecision(recipe, comm_dtype=comm)
    policy = plugin.fsdp_policy()
    assert (policy.param_dtype, policy.output_dtype) == ROOT[recipe]
    assert policy.reduce_dtype == COMM[comm]
    # a norm (kept in FP32 by the op policy) gathers FP32; an inner linear unit keeps its outputs low
    norm = plugin.fsdp_policy(nn.LayerNorm(4), "net.norm")
    assert (norm.param_dtype, norm.reduce_dtype, norm.output_dtype) == (None, COMM[comm], None)
    linear = plugin.fsdp_policy(nn.Linear(4, 4), "net.0")
    assert (linear.param_dtype, linear.output_dtype) == (ROOT[recipe][0], None)
    block = plugin.fsdp_policy(nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4)), "net")  # mixed unit: low
    assert block.param_dtype == ROOT[recipe][0]


@pytest.mark.parametrize("recipe", ["bf16-kahan", "bf16-sr"])
def test_update_rounding_recipes_have_no_fsdp_policy(recipe):
    from lightning.pytorch.utilities.exceptions import MisconfigurationException

    with pytest.raises(MisconfigurationException, match="no sharded form.*bf16-master"):
        MixedPrecision(recipe).fsdp_policy()
    with pytest.raises(ValueError, match="no sharded form"):
        FSDPMixedPrecision(recipe)


@pytest.mark.parametrize("recipe", list(ROOT))
def test_fsdp1_precision_passes_the_strategy_type_check_and_maps_the_recipe(recipe):
    plugin = FSDPMixedPrecision(recipe, comm_dtype="bfloat16")
    assert isinstance(plugin, FSDPPrecision)
    strategy = FSDPStrategy(precision_plugin=plugin)  # Lightning's setter refuses anything but FSDPPrecision
    assert strategy.precision_plugin is plugin
    config = strategy.mixed_precision_config
    assert (config.param_dtype, config.reduce_dtype, config.buffer_dtype) == (ROOT[recipe][0], BF16, None)
    assert isinstance(plugin.scaler, TorchLossScaler) == recipe.startswith("16-")  # fp16 recipes scale
    model = nn.Linear(2, 2)
    assert plugin.convert_module(model) is model and model.weight.dtype == FP32  # FP32 flat params: the masters
    state = plugin.state_dict()
    FSDPMixedPrecision(recipe, comm_dtype="bfloat16").load_state_dict(state)
    with pytest.raises(StateDictError, match="recipe"):
        FSDPMixedPrecision("bf16-master" if recipe != "bf16-master" else "16-master").load_state_dict(state)


def test_our_ddp_plugin_is_refused_by_fsdp1_with_the_alternative():
    with pytest.raises(TypeError, match="FSDPPrecision"):
        FSDPStrategy(precision_plugin=MixedPrecision("bf16-mixed"))


def test_comm_hook_choice_per_dtype():
    assert comm_hook("float32", {FP32}) is None  # DDP's own all-reduce: nothing registered
    assert comm_hook("float16", {FP32}) is default_hooks.fp16_compress_hook
    assert comm_hook("bfloat16", {FP32}) is default_hooks.bf16_compress_hook
    assert callable(comm_hook("float32", {BF16}))  # *-master under DDP: bf16 buckets reduced in FP32
    assert register_comm_hook(nn.Linear(2, 2), "float16") is None  # not DDP-wrapped: left alone
    assert MixedPrecision("16-mixed", comm_dtype="fp16").recipe.comm_dtype == "float16"
