"""LR schedulers on skipped steps: ``interval="step"`` schedulers hold, ``interval="epoch"`` ones advance
once per epoch whatever happened to the steps of that epoch.

Skips are forced under ``16-mixed`` (and ``16-master``) by multiplying the loss by inf on chosen
global steps; at the initial scale used here (2**8) this model never overflows by itself.
Lightning (2.6) steps the schedulers of a batch (the epoch ones too on an epoch's last batch)
before ``on_train_batch_end``, so the LR recorded there is the LR after that batch's updates.
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.plugins.precision import MixedPrecision as NativeMixedPrecision

from lightning_ext import MixedPrecision
from tests.lightning.helpers.models import TinyRegressor, loader, trainer_kwargs

LR, STEP_GAMMA, EPOCH_GAMMA = 0.01, 0.9, 0.5
SCALER = {"init_scale": 2.0**8}  # 2**16 overflows this model's fp16 gradients now and then
BATCHES = 4  # steps per epoch (loader of 32 samples, batch 8)
EPOCHS = 4
# global steps whose loss is inf: the first and last step of epoch 0, the whole of epoch 2
# (an epoch without one applied step), the last step of the run
INF_STEPS = {0, 3, 8, 9, 10, 11, 15}


class TwoSchedules(TinyRegressor):
    """Adam with a step-interval StepLR and an epoch-interval StepLR on the same optimizer (chained:
    each multiplies the current LR by its gamma)."""

    def __init__(self, **kw) -> None:
        super().__init__(inf_steps=INF_STEPS, lr=LR, **kw)

    def configure_optimizers(self):
        opt = torch.optim.Adam(self.parameters(), lr=self.lr)
        per_step = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=STEP_GAMMA)
        per_epoch = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=EPOCH_GAMMA)
        self.per_step, self.per_epoch = per_step, per_epoch
        return [opt], [{"scheduler": per_step, "interval": "step"},
                       {"scheduler": per_epoch, "interval": "epoch"}]


def _expected_lrs(applied: list[bool]) -> tuple[list[float], float]:
    """The LR after each step's scheduler updates, and the final LR, replaying the two schedules in
    Lightning's order (the step scheduler after each applied step, then the epoch scheduler after
    each epoch's last step)."""
    lr, out = LR, []
    for k, ok in enumerate(applied):
        if ok:
            lr *= STEP_GAMMA
        if (k + 1) % BATCHES == 0:
            lr *= EPOCH_GAMMA
        out.append(lr)
    return out, lr


def _fit(plugin):
    model = TwoSchedules()
    trainer = pl.Trainer(plugins=[plugin], max_epochs=EPOCHS, **trainer_kwargs())
    trainer.fit(model, loader(n=BATCHES * 8, batch_size=8))
    return model, trainer


@pytest.mark.parametrize("recipe", ["16-mixed", "16-master"])
def test_epoch_schedulers_advance_once_per_epoch_step_schedulers_hold_on_skips(recipe):
    model, trainer = _fit(MixedPrecision(recipe, scaler=SCALER))
    steps = EPOCHS * BATCHES
    applied = [k not in INF_STEPS for k in range(steps)]
    assert trainer.global_step == steps  # the trainer's batch counter counts skipped steps too
    assert (trainer.scaler.steps, trainer.scaler.skipped) == (steps, len(INF_STEPS))
    # the epoch schedule advanced once per epoch, including the epoch in which no step was applied
    assert model.per_epoch.last_epoch == EPOCHS
    # the step schedule advanced once per applied step only
    assert model.per_step.last_epoch == sum(applied)
    # the optimizer itself counted only the applied steps (Adam's step count)
    adam_steps = {int(s["step"]) for s in trainer.optimizers[0].state.values()}
    assert adam_steps == {sum(applied)}
    want, final = _expected_lrs(applied)
    assert model.lrs == pytest.approx(want, rel=1e-12)
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(final, rel=1e-12)
    # epoch 2 (steps 8-11) is skipped throughout: the LR holds until its end, then halves once
    assert model.lrs[7] == model.lrs[8] == model.lrs[9] == model.lrs[10]
    assert model.lrs[11] == pytest.approx(model.lrs[10] * EPOCH_GAMMA, rel=1e-12)


def test_lightnings_own_plugin_advances_on_skips_for_contrast():
    """The same run under Lightning's native AMP plugin steps the step schedule on every batch:
    the difference above is the plugin's doing, not the test's setup."""
    native = NativeMixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu", init_scale=SCALER["init_scale"]))
    model, trainer = _fit(native)
    steps = EPOCHS * BATCHES
    assert model.per_epoch.last_epoch == EPOCHS
    assert model.per_step.last_epoch == steps
    assert {int(s["step"]) for s in trainer.optimizers[0].state.values()} == {steps - len(INF_STEPS)}


class PlateauPerEpoch(TinyRegressor):
    """Adam with ReduceLROnPlateau (interval epoch, monitoring the epoch's mean training loss)."""

    def __init__(self) -> None:
        super().__init__(inf_steps=INF_STEPS, lr=LR)

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("fit_loss", loss.detach(), on_step=False, on_epoch=True)  # inf on the skipped steps
        return loss

    def configure_optimizers(self):
        opt = torch.optim.Adam(self.parameters(), lr=self.lr)
        self.plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=0)
        return {"optimizer": opt,
                "lr_scheduler": {"scheduler": self.plateau, "interval": "epoch", "monitor": "fit_loss"}}


def test_epoch_plateau_scheduler_steps_with_its_metric_every_epoch_despite_skips():
    model = PlateauPerEpoch()
    seen = []

    class Spy(pl.Callback):
        def on_train_epoch_end(self, trainer, pl_module):  # before the epoch's scheduler step
            seen.append(pl_module.plateau.last_epoch)

    trainer = pl.Trainer(plugins=[MixedPrecision("16-mixed", scaler=SCALER)], max_epochs=EPOCHS, callbacks=[Spy()],
                         **trainer_kwargs())
    trainer.fit(model, loader(n=BATCHES * 8, batch_size=8))
    assert trainer.scaler.skipped == len(INF_STEPS)
    assert seen == list(range(EPOCHS))
    assert model.plateau.last_epoch == EPOCHS  # one metric-driven step per epoch, epoch 2 included
    # the metric reached the scheduler: every epoch's mean loss is inf (each epoch has an inf step),
    # never an improvement after the first, so with patience 0 every later epoch halves the LR
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(LR * 0.5 ** (EPOCHS - 1), rel=1e-12)
