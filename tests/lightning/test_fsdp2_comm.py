"""FSDP2 communication precision on two CPU processes (gloo; this file's ``worker`` runs in the test
run's one torchrun launch, helpers/torchrun.py).

``plugin.comm_counter`` counts what FSDP2 hands to its reduce-scatters and all-gathers; references: the
core's estimate (``fsdp_step_bytes``, from the units' shapes and policies), the same run without the
counter (bit for bit), and an FP32 reduction of the same injected gradient (no overflow there).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.lightning.helpers.torchrun import quiet_rank

pytestmark = pytest.mark.multiprocess

STEPS, BATCH, BOOST_STEP = 3, 8, 1
RUNS = {  # name: (recipe, comm_dtype, counted, boosted)
    "mixed_bf16": ("16-mixed", "bfloat16", True, False),
    "mixed_bf16_plain": ("16-mixed", "bfloat16", False, False),
    "master_bf16": ("bf16-master", "bfloat16", True, False),
    "boost_fp16": ("16-mixed", "float16", False, True),
    "boost_fp32": ("16-mixed", "float32", True, True),  # counted too: the boost changes values, not bytes
}


@pytest.fixture(scope="module")
def ranks(torchrun_out):
    """Every run on 2 processes; returns [rank 0's results, rank 1's results]."""
    out = torchrun_out(__name__)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in (0, 1)]


def _equal(a: dict, b: dict) -> bool:
    return sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("run, reduce, gather", [
    ("boost_fp32", "float32", "float32"), ("mixed_bf16", "bfloat16", "float32"),
    ("master_bf16", "bfloat16", "bfloat16")])
def test_counted_fsdp2_bytes_per_step_equal_the_core_estimate(ranks, run, reduce, gather):
    for r in ranks:
        got = r[run]
        assert got["by_op"] == {op: {d: STEPS * b for d, b in per.items()} for op, per in got["estimate"].items()}
        assert set(got["by_op"]["reduce_scatter"]) == {reduce} and set(got["by_op"]["all_gather"]) == {gather}
        # by hand: Linear(8, 15) + bias padded to 16 rows, and the root's Linear(15, 2) + bias (2 rows)
        padded = 16 * 8 + 16 + 2 * 15 + 2
        assert got["by_op"]["reduce_scatter"][reduce] == STEPS * padded * (4 if reduce == "float32" else 2)
    fp32, bf16 = ranks[0]["boost_fp32"]["by_op"], ranks[0]["mixed_bf16"]["by_op"]
    assert bf16["reduce_scatter"]["bfloat16"] * 2 == fp32["reduce_scatter"]["float32"]  # halved
    assert bf16["all_gather"] == fp32["all_gather"]  # 16-mixed gathers FP32 whatever it reduces in


def test_counting_does_not_change_training(ranks):
    for r in ranks:
        assert _equal(r["mixed_bf16"]["params"], r["mixed_bf16_plain"]["params"])
        assert r["mixed_bf16"]["losses"] == r["mixed_bf16_plain"]["losses"]


def test_fp16_reduce_scatter_overflow_on_one_shard_is_skipped_by_every_rank(ranks):
    # rank 1's FP32 gradient gets 1e9 in row 0 of the first weight (rank 0's shard) at BOOST_STEP:
    # finite before the reduction, inf once cast to float16 for the reduce-scatter, on rank 0's shard only
    local_inf = [r["boost_fp16"]["local_inf"] for r in ranks]
    assert local_inf[0][BOOST_STEP] and not local_inf[1][BOOST_STEP]
    for r in ranks:
        fp16, fp32 = r["boost_fp16"], r["boost_fp32"]
        assert fp16["skips"] == [s == BOOST_STEP for s in range(STEPS)]  # both ranks skip that step
        assert _equal(fp16["after"][BOOST_STEP], fp16["after"][BOOST_STEP - 1])  # nothing moved on either shard
        assert fp16["scales"][BOOST_STEP + 1] == fp16["scales"][BOOST_STEP] / 2  # both scales back off
        assert not any(fp32["skips"]) and not any(fp32["local_inf"])  # FP32's range: no overflow
    assert ranks[0]["boost_fp16"]["scales"] == ranks[1]["boost_fp16"]["scales"]


# --------------------------------------------------------------------------- the worker (under torchrun)
def worker(out: str) -> None:
    import lightning.pytorch as pl
    import torch.nn.functional as F
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch import nn
    from torch.utils.data import DataLoader, DistributedSampler

    from lightning_ext import CommCounter, MixedPrecision
    from lightning_ext.distributed import fsdp_comm_units, fully_shard_model, local
    from mp_callbacks.memory import fsdp_step_bytes
    from tests.lightning.helpers.models import regression_data, trainer_kwargs

    rank = quiet_rank()

    class Block(nn.Linear):
        """The sharded unit (resharded after forward: gathered again for backward)."""

    class Model(pl.LightningModule):
        def __init__(self, boost: bool) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(Block(8, 15), nn.ReLU(), nn.Linear(15, 2))  # 15 rows: padded to 16
            self.boost, self.losses, self.skips, self.local_inf, self.after, self.scales = boost, [], [], [], [], []

        def configure_model(self) -> None:
            if not hasattr(self.net, "_get_fsdp_state"):
                fully_shard_model(self.net, self.trainer.precision_plugin.recipe, self.device_mesh["data_parallel"],
                                  units=["Block"])
                self.net[0].register_forward_pre_hook(self._inject)  # after FSDP2's: the weight is gathered

        def _inject(self, module, args) -> None:
            if self.boost and rank == 1 and self.trainer.global_step == BOOST_STEP:
                handle = None

                def boost(grad):  # finite in FP32, beyond float16's range
                    handle.remove()
                    grad = grad.clone()
                    grad[0, 0] = 1e9
                    return grad
                handle = module.weight.register_hook(boost)

        def training_step(self, batch, batch_idx):
            loss = F.mse_loss(self.net(batch[0]).float(), batch[1])
            self.losses.append(float(loss))
            return loss

        def on_before_optimizer_step(self, optimizer) -> None:
            self.local_inf.append(any(not torch.isfinite(local(p.grad)).all() for p in self.parameters()))
            self.scales.append(float(self.trainer.precision_plugin.loss_scaler.get_scale()))

        def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
            self.skips.append(self.trainer.precision_plugin.last_step_skipped())
            self.after.append({n: local(p).detach().clone() for n, p in self.named_parameters()})

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-2)

    data = regression_data(2 * STEPS * BATCH, 8)
    results = {}
    for name, (recipe, comm, counted, boost) in RUNS.items():
        plugin = MixedPrecision(recipe, scaler={"init_scale": 2.0**8} if recipe == "16-mixed" else None,
                                comm_dtype=comm)
        plugin.comm_counter = CommCounter() if counted else None
        model = Model(boost)
        loader = DataLoader(data, batch_size=BATCH, sampler=DistributedSampler(data, 2, rank, shuffle=False))
        trainer = pl.Trainer(plugins=[plugin], strategy=ModelParallelStrategy(data_parallel_size=2,
                                                                              tensor_parallel_size=1),
                             max_steps=STEPS, use_distributed_sampler=False, **trainer_kwargs(devices=2))
        trainer.fit(model, loader)
        units, world = fsdp_comm_units(model)
        results[name] = {"losses": model.losses, "skips": model.skips, "local_inf": model.local_inf,
                         "after": model.after, "params": model.after[-1], "scales": model.scales,
                         "by_op": None if not counted else plugin.comm_counter.by_op,
                         "estimate": fsdp_step_bytes(units, world)}
    torch.save(results, Path(out) / f"rank{rank}.pt")
