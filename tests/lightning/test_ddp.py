"""Two CPU processes (gloo): an overflow seen by rank 0 only makes both ranks skip."""

import lightning.pytorch as pl
import pytest
import torch

from lightning_ext import MixedPrecision
from tests.lightning.helpers.models import SaveRankState, TinyRegressor, loader, trainer_kwargs

GRAD_INF_STEPS = {2, 5}  # injected into rank 0's gradients *after* DDP's all-reduce

pytestmark = pytest.mark.multiprocess


def test_ddp_spawn_overflow_on_one_rank_skips_everywhere(tmp_path):
    model = TinyRegressor(grad_inf_steps=GRAD_INF_STEPS, grad_inf_rank=0, scheduler=True)
    trainer = pl.Trainer(
        plugins=[MixedPrecision("16-master", scaler={"init_scale": 2.0**8, "growth_interval": 1000})],
        strategy="ddp_spawn",
        max_steps=8,
        callbacks=[SaveRankState(str(tmp_path))],
        **trainer_kwargs(devices=2),
    )
    trainer.fit(model, loader(n=128))
    r0 = torch.load(tmp_path / "rank0.pt", weights_only=True)
    r1 = torch.load(tmp_path / "rank1.pt", weights_only=True)
    for r in (r0, r1):
        assert r["skipped"] == r["overflows"] == len(GRAD_INF_STEPS)
        assert r["adam_steps"] == [8 - len(GRAD_INF_STEPS)]
        assert r["scale"] == 2.0**8 / 4
        assert all(torch.isfinite(p).all() for p in r["params"].values())
    for name in r0["params"]:
        assert torch.equal(r0["params"][name], r1["params"][name]), name
    for name in r0["masters"]:
        assert torch.equal(r0["masters"][name], r1["masters"][name]), name
    assert r0["lrs"] == r1["lrs"]
    assert r0["lrs"][2] == r0["lrs"][1]  # LR held on the skipped step on both ranks
