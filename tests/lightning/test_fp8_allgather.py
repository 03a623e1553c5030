"""FP8 all-gather under FSDP2 (``fp8={"fsdp_float8_all_gather": True}``) on two CPU processes (gloo, torchrun).

References: torchao's ``Float8LinearConfig(enable_fsdp_float8_all_gather=True, emulate=True)`` under the same
sharding (its gathered bytes per step, its gathered e4m3 weight and its cast ``hp_tensor_to_float8_dynamic`` of
the unsharded FP32 weight), the core's NumPy reference of the sharded cast (``sharded_fp8_cast``) and byte
estimate (``fsdp_step_bytes``), and the same runs all-gathering bf16 (the training they must agree with).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException

from lightning_ext import MixedPrecision
from mp_callbacks.fp8 import FP8Recipe, FP8State, sharded_fp8_cast
from tests.lightning.helpers.torchrun import quiet_rank

pytestmark = pytest.mark.multiprocess

STEPS, BATCH = 24, 8
CURRENT = {"preset": "torchao"}  # current scaling: torchao's tensorwise recipe
DELAYED = {"history_len": 4}  # Transformer Engine's delayed scaling
RUNS = {  # name: (recipe, fp8 settings, FP8 all-gather, model with a row count that does not split evenly)
    "bf16": ("fp8-mixed", CURRENT, False, False),
    "fp8": ("fp8-mixed", CURRENT, True, False),
    "bf16_delayed": ("fp8-mixed", DELAYED, False, True),
    "fp8_delayed": ("fp8-mixed", DELAYED, True, True),
    "master": ("bf16-master", None, False, False),  # no FP8 matmuls: FP8's own distance from bf16 training
    "master_uneven": ("bf16-master", None, False, True),
}
GATHERED = ("net.0", "net.2", "net.4")  # the FP8 Linear layers (every one: the policy keeps none in FP32)


@pytest.fixture(scope="module")
def ranks(torchrun_out):
    """Every run on 2 processes; returns [rank 0's results, rank 1's results]."""
    out = torchrun_out(__name__)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in (0, 1)]


def _unsharded(ranks, run, step, name):
    return torch.cat([r[run]["shards"][step][name] for r in ranks])


# ----------------------------------------------------------------------- settings (one process)
def test_without_fsdp2_the_setting_is_refused_with_the_fix():
    import lightning.pytorch as pl

    from tests.lightning.helpers.models import TinyRegressor, loader, trainer_kwargs

    plugin = MixedPrecision("fp8-mixed", fp8={"fsdp_float8_all_gather": True})
    trainer = pl.Trainer(plugins=[plugin], max_steps=1, **trainer_kwargs())
    with pytest.raises(MisconfigurationException, match="not an FSDP2-sharded FP8 weight.*fully_shard_model"):
        trainer.fit(TinyRegressor(), loader())


def test_a_saved_fp8_all_gather_weight_is_its_plain_fp32_tensor(tmp_path):
    from torch import nn

    from lightning_ext.fp8.allgather import FP8AllGatherWeight, wrap_weights

    layer = nn.Linear(4, 3)
    expected = layer.weight.detach().clone()
    assert wrap_weights([("layer", layer)]) == ["layer"] and isinstance(layer.weight, FP8AllGatherWeight)
    torch.save(layer.state_dict(), tmp_path / "w.pt")
    loaded = torch.load(tmp_path / "w.pt", weights_only=True)  # no subclass to allow: a plain tensor
    assert type(loaded["weight"]) is torch.Tensor and torch.equal(loaded["weight"], expected)
    plain = nn.Linear(4, 3)
    plain.load_state_dict(loaded)
    layer.load_state_dict(plain.state_dict())  # and back into the wrapped weight
    assert isinstance(layer.weight, FP8AllGatherWeight) and torch.equal(layer.weight._tensor, expected)


# --------------------------------------------------------------------- two processes
def test_gathered_bytes_are_fp8_and_equal_torchao_and_the_estimate(ranks):
    for r in ranks:
        for run in RUNS:
            assert r[run]["by_op"]["all_gather"] == {d: STEPS * b for d, b in r[run]["estimate"]["all_gather"].items()}
        fp8, bf16 = (sum(r[run]["by_op"]["all_gather"].values()) for run in ("fp8", "bf16"))
        assert r["fp8"]["by_op"]["all_gather"] == r["ao"]["by_op"]["all_gather"]  # torchao's bytes per step
        assert set(r["fp8"]["by_op"]["all_gather"]) == {"uint8"} and set(r["bf16"]["by_op"]["all_gather"]) == {
            "bfloat16"}
        # by hand: weights 1 byte instead of 2, biases stay bf16; units resharded after forward gather twice
        weights, biases = 32 * 16 + 16 * 32 + 2 * 16, 32 + 16 + 2
        assert fp8 == STEPS * 2 * (weights + 2 * biases) and bf16 == STEPS * 2 * 2 * (weights + biases)
        assert r["fp8"]["by_op"]["reduce_scatter"] == r["bf16"]["by_op"]["reduce_scatter"]


def test_the_gathered_fp8_weight_is_the_cast_of_the_unsharded_weight_bit_for_bit(ranks):
    from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
    from torchao.float8.float8_training_tensor import LinearMMConfig

    for run, settings in (("fp8", CURRENT), ("fp8_delayed", DELAYED)):
        config = FP8Recipe.coerce(settings).config("weights")
        for step in range(STEPS):
            for name in GATHERED:
                shards = [r[run]["shards"][step][name] for r in ranks]
                got = [r[run]["gathered"][step][name] for r in ranks]
                assert torch.equal(got[0]["q"], got[1]["q"]) and torch.equal(got[0]["inv"], got[1]["inv"])
                state = None
                if config.mode == "delayed":  # the committed scale, the same on both ranks
                    assert torch.equal(got[0]["scale"], got[1]["scale"])
                    state = FP8State(np.zeros(config.history_len, np.float32), got[0]["scale"].numpy(),
                                     got[0]["inv"].numpy(), np.int32(0), np.int32(0))
                q, _, inv = sharded_fp8_cast([s.numpy() for s in shards], config, state)
                ref = torch.from_numpy(np.concatenate(q)).to(torch.float8_e4m3fn)
                assert torch.equal(got[0]["q"].view(torch.float8_e4m3fn)[: ref.shape[0]].view(torch.uint8),
                                   ref.view(torch.uint8)), (run, step, name)
                assert float(got[0]["inv"]) == float(inv)
                if run == "fp8":  # torchao's cast of the unsharded FP32 weight
                    ao = hp_tensor_to_float8_dynamic(torch.cat(shards), torch.float8_e4m3fn, LinearMMConfig())
                    assert torch.equal(got[0]["q"], ao._data.view(torch.uint8))
                    assert float(got[0]["inv"]) == float(1 / ao._scale.float())
    for name in GATHERED:  # torchao's own FP8 all-gather of the same initial weights
        ao = [r["ao"]["gathered"][0][name] for r in ranks]
        assert torch.equal(ranks[0]["fp8"]["gathered"][0][name]["q"], ao[0]["q"])
        assert float(ranks[0]["fp8"]["gathered"][0][name]["inv"]) == float(1 / ao[0]["scale"])


def test_training_equals_the_bf16_all_gather_run_within_fp8_bounds(ranks):
    # the bound: FP8 matmuls' own distance from bf16 training (fp8-mixed gathering bf16 vs bf16-master),
    # step by step over the run; gathering the weights in FP8 moves the loss curve by less than that
    for fp8_run, bf16_run, master in (("fp8", "bf16", "master"), ("fp8_delayed", "bf16_delayed", "master_uneven")):
        for r in ranks:
            fp8, bf16, ref = (np.array(r[run]["losses"]) for run in (fp8_run, bf16_run, master))
            gap, bound = np.abs(fp8 - bf16) / bf16, np.abs(bf16 - ref) / ref
            assert gap.mean() <= bound.mean() and gap.max() <= bound.max(), (fp8_run, gap, bound)
            assert fp8[-4:].mean() < 0.5 * fp8[:4].mean() and bf16[-4:].mean() < 0.5 * bf16[:4].mean()  # both train
            assert not any(r[fp8_run]["skips"])


# --------------------------------------------------------------------------- the worker (under torchrun)
def worker(out: str) -> None:
    import lightning.pytorch as pl
    import torch.nn.functional as F
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch import nn
    from torch.utils.data import DataLoader, DistributedSampler

    from lightning_ext import CommCounter
    from lightning_ext.distributed import count_fsdp_collectives, fsdp_comm_units, fully_shard_model, local
    from mp_callbacks.memory import fsdp_step_bytes
    from tests.lightning.helpers.models import regression_data, trainer_kwargs

    rank = quiet_rank()

    class Block(nn.Linear):
        """A sharded unit (resharded after forward: gathered again for backward)."""

    def make_net(uneven: bool) -> nn.Sequential:
        torch.manual_seed(0)
        rows = 15 if uneven else 16  # 15: padded to 16 rows for 2 shards
        return nn.Sequential(Block(16, 32), nn.ReLU(), Block(32, rows), nn.ReLU(), Block(rows, 2))

    def plain(t):
        return getattr(local(t), "_tensor", local(t)).detach().clone()

    def capture(module, args, into, name, fp8_of=None):  # after FSDP2's pre-forward hook: the gathered weight
        if not torch.is_grad_enabled():
            return
        w = module.weight
        data = getattr(w, "_data", None)
        entry = {"q": data.reshape(w.shape).view(torch.uint8).clone(),
                 "inv": getattr(w, "_scale_inv", None), "scale": getattr(w, "_scale", None)}
        if fp8_of is not None and fp8_of() is not None:
            fp8 = fp8_of()
            entry["scale"] = fp8.state_of("weights", fp8._index[name]).scale.clone()
        into.setdefault("now", {})[name] = {k: v.clone() if v is not None else None for k, v in entry.items()}

    class Model(pl.LightningModule):
        def __init__(self, uneven: bool, gathered_fp8: bool) -> None:
            super().__init__()
            self.net = make_net(uneven)
            self.gathered_fp8 = gathered_fp8
            self.losses, self.skips, self.shards, self.gathered, self._now = [], [], [], [], {}

        def configure_model(self) -> None:
            if not hasattr(self.net, "_get_fsdp_state"):
                fully_shard_model(self.net, self.trainer.precision_plugin.recipe, self.device_mesh["data_parallel"],
                                  units=["Block"])
                if self.gathered_fp8:
                    for i in (0, 2, 4):
                        self.net[i].register_forward_pre_hook(
                            lambda m, a, n=f"net.{i}": capture(m, a, self._now, n,
                                                               lambda: self.trainer.precision_plugin.fp8))

        def on_train_batch_start(self, batch, batch_idx) -> None:
            self.shards.append({f"net.{i}": plain(self.net[i].weight) for i in (0, 2, 4)})

        def training_step(self, batch, batch_idx):
            loss = F.mse_loss(self.net(batch[0]).float().mean(-1, keepdim=True), batch[1])
            self.losses.append(float(loss))
            return loss

        def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
            self.skips.append(self.trainer.precision_plugin.last_step_skipped())
            self.gathered.append(self._now.pop("now", {}))

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-2)

    data = regression_data(2 * STEPS * BATCH, 16)
    results = {}
    for name, (recipe, settings, gather, uneven) in RUNS.items():
        fp8 = None if settings is None else {**settings, "fsdp_float8_all_gather": gather}
        plugin = MixedPrecision(recipe, fp8=fp8)
        plugin.comm_counter = CommCounter()
        model = Model(uneven, gather)
        loader = DataLoader(data, batch_size=BATCH, sampler=DistributedSampler(data, 2, rank, shuffle=False))
        trainer = pl.Trainer(plugins=[plugin], strategy=ModelParallelStrategy(data_parallel_size=2,
                                                                              tensor_parallel_size=1),
                             max_steps=STEPS, use_distributed_sampler=False, **trainer_kwargs(devices=2))
        trainer.fit(model, loader)
        units, world = fsdp_comm_units(model)
        results[name] = {"losses": model.losses, "skips": model.skips, "shards": model.shards,
                         "gathered": model.gathered, "by_op": plugin.comm_counter.by_op,
                         "estimate": fsdp_step_bytes(units, world)}

    # torchao's FP8 all-gather of the same net, sharded the same way (first step: its gathered weights)
    from torch.distributed.fsdp import fully_shard
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    from lightning_ext.distributed import fsdp_policy

    net = make_net(False)
    convert_to_float8_training(net, config=Float8LinearConfig(enable_fsdp_float8_all_gather=True, emulate=True))
    mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (2,))
    recipe = MixedPrecision("fp8-mixed", fp8=CURRENT).recipe
    for i in (0, 2, 4):
        fully_shard(net[i], mesh=mesh, mp_policy=fsdp_policy(recipe, root=False))
    fully_shard(net, mesh=mesh, mp_policy=fsdp_policy(recipe))
    counter, now = CommCounter(), {}
    count_fsdp_collectives(net, counter)
    for i in (0, 2, 4):
        net[i].register_forward_pre_hook(lambda m, a, n=f"net.{i}": capture(m, a, now, n))
    optimizer = torch.optim.Adam(net.parameters(), lr=1e-2)
    gathered = []
    for x, y in DataLoader(data, batch_size=BATCH, sampler=DistributedSampler(data, 2, rank, shuffle=False)):
        F.mse_loss(net(x).float().mean(-1, keepdim=True), y).backward()
        optimizer.step()
        optimizer.zero_grad()
        gathered.append(now.pop("now"))
    results["ao"] = {"by_op": counter.by_op, "gathered": gathered}
    torch.save(results, Path(out) / f"rank{rank}.pt")
