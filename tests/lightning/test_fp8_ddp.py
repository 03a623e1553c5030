"""``fp8-mixed`` under DDP (2 CPU processes, ddp_fork, gloo): the FP8 amaxes are reduced (MAX) over ranks
before the delayed-scaling update, as Transformer Engine does, so ranks fed different data hold the same
FP8 scales and the same weights.  Reference: the core's transition (NumPy) replayed on the element-wise max
of both ranks' own amaxes.
"""

from __future__ import annotations

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_ext import MixedPrecision
from mp_callbacks.fp8 import FP8_ROLES, initial_fp8_state, next_fp8_state
from tests.lightning.helpers.models import ddp_fork, loader, trainer_kwargs

pytestmark = pytest.mark.multiprocess

STEPS = 4


class Net(pl.LightningModule):
    """Linear-ReLU-Linear; rank 1's inputs are 4x rank 0's scale (different amaxes per rank)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.net(x * (1 + 3 * self.global_rank)).float(), y)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)


class Record(pl.Callback):
    """Per step this rank's own amaxes (before the reduction); at the end the FP8 states and weights."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir, self.local = out_dir, []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        fp8 = trainer.precision_plugin.fp8  # the step's amaxes as recorded, before_step has reduced a copy
        self.local.append({r: [float(a) for a in fp8._amax[r]] for r in FP8_ROLES})

    def on_train_end(self, trainer, pl_module) -> None:
        torch.save({"local": self.local, "fp8": trainer.precision_plugin.fp8.state_dict(),
                    "params": {n: p.detach().clone() for n, p in pl_module.named_parameters()},
                    "skipped": trainer.precision_plugin.loss_scaler.skipped},
                   f"{self.out_dir}/rank{trainer.global_rank}.pt")


def test_ranks_with_different_data_take_the_same_fp8_scales(tmp_path):
    plugin = MixedPrecision("fp8-mixed", fp8={"history_len": 3})
    trainer = pl.Trainer(plugins=[plugin], strategy=ddp_fork(), max_steps=STEPS,
                         callbacks=[Record(str(tmp_path))], **trainer_kwargs(devices=2))
    trainer.fit(Net(), loader(n=64))
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1))
    assert r0["skipped"] == r1["skipped"] == 0
    assert len(r0["local"]) == len(r1["local"]) == STEPS
    for step in range(STEPS):  # the ranks saw different inputs and output gradients
        for role in ("inputs", "grad_outputs"):
            assert r0["local"][step][role] != r1["local"][step][role], (step, role)
    assert r0["fp8"] == r1["fp8"]  # the same histories and scales on both ranks
    for name, p in r0["params"].items():
        assert torch.equal(p, r1["params"][name]), name
    configs = plugin.recipe.fp8.configs
    for role in FP8_ROLES:  # the reference: the core's transition on max(rank 0's amax, rank 1's amax)
        for j, state in enumerate(r0["fp8"]["states"][role]):
            ref = initial_fp8_state(configs[role])
            for step in range(STEPS):
                amax = np.float32(max(r0["local"][step][role][j], r1["local"][step][role][j]))
                ref, _ = next_fp8_state(configs[role], ref, amax)
            assert state["amax_history"] == [float(v) for v in np.asarray(ref.amax_history, np.float32)], (role, j)
            assert state["scale"] == float(ref.scale) and state["scale_inv"] == float(ref.scale_inv), (role, j)
