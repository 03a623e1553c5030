"""On a skipped step nothing the model learns from changes; training features keep working."""

import lightning.pytorch as pl
import pytest
import torch

from lightning_ext import MixedPrecision
from tests.lightning.helpers.models import TinyRegressor, loader, params_of, trainer_kwargs

SKIP = {3, 4, 7}


class Snapshots(pl.Callback):
    """After every batch: params, FP32 masters, the Adam state of every optimizer param, LR."""

    def __init__(self) -> None:
        self.rows: list[dict] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        opt = trainer.optimizers[0]
        first = opt.param_groups[0]["params"][0]
        state = opt.state.get(first, {})
        slots = {f"{i}.{k}": v.clone() for i, p in enumerate(opt.param_groups[0]["params"])
                 for k, v in opt.state.get(p, {}).items() if torch.is_tensor(v)}
        self.rows.append({
            "slots": slots,
            "params": params_of(pl_module),
            "masters": {k: v.clone() for k, v in trainer.precision_plugin.master_state_dict().items()},
            "step": int(state["step"]) if "step" in state else 0,
            "exp_avg": state["exp_avg"].clone() if "exp_avg" in state else None,
            "lr": opt.param_groups[0]["lr"],
            "scale": trainer.scaler.get_scale(),
        })


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("recipe", ["16-mixed", "16-master", "bf16-master"])
def test_skipped_steps_change_nothing(recipe):
    snaps = Snapshots()
    plugin = MixedPrecision(recipe, scaler={"init_scale": 2.0**8, "growth_interval": 1000})
    model = TinyRegressor(inf_steps=SKIP, scheduler=True, norm=True)
    trainer = pl.Trainer(plugins=[plugin], max_steps=10, callbacks=[snaps], **trainer_kwargs())
    trainer.fit(model, loader())
    rows = snaps.rows
    assert len(rows) == 10
    for k in range(1, 10):
        before, after = rows[k - 1], rows[k]
        if k in SKIP:
            assert _same(before["params"], after["params"]), k
            assert _same(before["masters"], after["masters"]), k
            assert after["step"] == before["step"], k
            assert torch.equal(before["exp_avg"], after["exp_avg"]), k
            assert _same(before["slots"], after["slots"]), k  # step, exp_avg, exp_avg_sq of every param
            assert after["lr"] == before["lr"], k  # the LR scheduler did not advance
            assert after["scale"] == before["scale"] / 2
        else:
            assert not _same(before["params"], after["params"]), k
            assert after["step"] == before["step"] + 1, k
            assert after["lr"] == pytest.approx(before["lr"] * 0.9), k
    assert rows[-1]["step"] == 10 - len(SKIP)
    assert trainer.scaler.skipped == len(SKIP)
    if recipe.endswith("master"):
        # masters are FP32 and the low-precision params are their rounded copies
        low = torch.float16 if recipe.startswith("16") else torch.bfloat16
        masters = plugin.master_state_dict()
        assert masters and all(m.dtype == torch.float32 for m in masters.values())
        named = dict(model.named_parameters())
        for name, master in masters.items():
            assert named[name].dtype == low
            assert torch.equal(named[name], master.to(low)), name
        assert named["net.1.weight"].dtype == torch.float32  # LayerNorm kept in FP32
        assert all(p.dtype == torch.float32 for g in trainer.optimizers[0].param_groups for p in g["params"])
        assert all(v.dtype == torch.float32 for s in trainer.optimizers[0].state.values()
                   for v in s.values() if v.dim())


def test_training_step_returning_none_and_accumulation():
    """``None`` from training_step skips the update; accumulation unscales once per step."""
    snaps = Snapshots()
    plugin = MixedPrecision("16-master", scaler={"init_scale": 2.0**8})
    model = TinyRegressor(return_none_steps={2}, scheduler=True)
    trainer = pl.Trainer(plugins=[plugin], max_steps=4, accumulate_grad_batches=2, callbacks=[snaps],
                         **trainer_kwargs())
    trainer.fit(model, loader())
    # 8 batches -> 4 optimizer steps; global step 2 returned None on both micro-batches
    steps = [r["step"] for r in snaps.rows[1::2]]
    assert steps == [1, 2, 2, 3]
    assert trainer.scaler.steps == 3 and trainer.scaler.skipped == 0
    assert all(p.grad is None for p in model.parameters() if p.dtype != torch.float32)


@pytest.mark.parametrize("algorithm", ["norm", "value"])
def test_gradient_clipping_sees_unscaled_fp32_grads(algorithm):
    seen = []

    clipped = []

    class Probe(pl.Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            # unscaled already: compare against the scale-free magnitude
            grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
            seen.append((max(float(g.abs().max()) for g in grads), {g.dtype for g in grads}))

        def on_train_start(self, trainer, pl_module):
            def pre(optimizer, args, kwargs):  # inside optimizer.step(): the grads it applies, clipped
                clipped.append([p.grad.clone() for p in optimizer.param_groups[0]["params"]])
            trainer.optimizers[0].register_step_pre_hook(pre)

    plugin = MixedPrecision("16-master", scaler={"init_scale": 2.0**12})
    model = TinyRegressor(optimizer="sgd", lr=0.05)
    trainer = pl.Trainer(plugins=[plugin], max_steps=3, gradient_clip_val=0.01, gradient_clip_algorithm=algorithm,
                         callbacks=[Probe()], **trainer_kwargs())
    trainer.fit(model, loader())
    assert all(dtypes == {torch.float32} for _, dtypes in seen)
    assert all(m < 1e3 for m, _ in seen)  # scaled grads would be ~2**12 times larger
    assert len(clipped) == 3
    for grads in clipped:
        if algorithm == "value":
            assert all(float(g.abs().max()) <= 0.01 + 1e-9 for g in grads)
        else:
            total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
            assert float(total) <= 0.01 * (1 + 1e-4)


def test_fused_adam_with_clipping_and_skip():
    plugin = MixedPrecision("16-mixed", scaler={"init_scale": 2.0**8})
    model = TinyRegressor(fused=True, inf_steps={1})
    trainer = pl.Trainer(plugins=[plugin], max_steps=4, gradient_clip_val=1.0, **trainer_kwargs())
    before = params_of(model)
    trainer.fit(model, loader())
    assert trainer.scaler.skipped == 1
    assert {int(s["step"]) for s in trainer.optimizers[0].state.values()} == {3}
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert not all(torch.equal(before[k], v) for k, v in params_of(model).items())


class TwoOptimizers(pl.LightningModule):
    """Manual optimization with two optimizers and a manual clip; inf injected for ``g`` at step 1."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.automatic_optimization = False
        self.g = torch.nn.Linear(8, 1)
        self.d = torch.nn.Linear(8, 1)
        self.skips: list[tuple[bool, bool]] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        opt_g, opt_d = self.optimizers()
        loss_g = torch.nn.functional.mse_loss(self.g(x).float(), y)
        if batch_idx == 1:
            loss_g = loss_g * float("inf")
        opt_g.zero_grad()
        self.manual_backward(loss_g)
        self.clip_gradients(opt_g, gradient_clip_val=1.0, gradient_clip_algorithm="norm")
        opt_g.step()
        loss_d = torch.nn.functional.mse_loss(self.d(x).float(), y)
        opt_d.zero_grad()
        self.manual_backward(loss_d)
        opt_d.step()
        plugin = self.trainer.precision_plugin
        self.skips.append((plugin.last_step_skipped(opt_g), plugin.last_step_skipped(opt_d)))

    def configure_optimizers(self):
        return torch.optim.Adam(self.g.parameters(), lr=1e-2), torch.optim.SGD(self.d.parameters(), lr=1e-2)


@pytest.mark.parametrize("recipe", ["16-mixed", "16-master"])
def test_manual_optimization_two_optimizers(recipe):
    model = TwoOptimizers()
    plugin = MixedPrecision(recipe, scaler={"init_scale": 2.0**8})
    trainer = pl.Trainer(plugins=[plugin], max_steps=6, **trainer_kwargs())
    trainer.fit(model, loader())
    assert model.skips[:3] == [(False, False), (True, False), (False, False)]
    opt_g = trainer.optimizers[0]
    assert {int(s["step"]) for s in opt_g.state.values()} == {2}  # 3 batches, one skipped
    assert trainer.scaler.steps == 6 and trainer.scaler.skipped == 1
    assert all(torch.isfinite(p).all() for p in model.parameters())
