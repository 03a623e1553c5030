"""Non-finite steps never reach the weights, and a run that cannot recover stops early, in every recipe."""

import lightning.pytorch as pl
import pytest
import torch

from lightning_ext import MixedPrecision
from mp_callbacks.diagnostics import DivergenceError
from mp_callbacks.recipes import RECIPE_NAMES
from tests.lightning.helpers.models import TinyRegressor, loader, trainer_kwargs


class Recorder(pl.Callback):
    def __init__(self):
        self.finite = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.finite.append(all(torch.isfinite(p).all() for p in pl_module.parameters()))


@pytest.mark.parametrize("recipe", RECIPE_NAMES)
def test_nan_every_step_stops_within_ten_steps_with_nothing_applied(recipe):
    model, rec = TinyRegressor(inf_steps=set(range(100))), Recorder()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    plugin = MixedPrecision(recipe)
    with pytest.raises(DivergenceError, match="loss was not finite on 5 consecutive steps.*no loss scale fixes"):
        pl.Trainer(plugins=[plugin], max_steps=50, callbacks=[rec], **trainer_kwargs()).fit(model, loader())
    assert plugin.loss_scaler.skipped == 4 and all(rec.finite)  # the 5th step raised before its update
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name].to(value.dtype)), name  # *-master: the rounded originals


def test_overflow_at_a_finite_loss_below_scale_one_stops():
    """Gradients overflow in the backward only (finite loss): the scale backs off below 1, then the rule stops."""
    model = TinyRegressor(grad_inf_steps=set(range(100)))
    plugin = MixedPrecision("16-mixed", scaler={"init_scale": 4.0}, divergence={"overflows_below": 3})
    with pytest.raises(DivergenceError, match="overflowed on 3 consecutive steps with a finite loss"):
        pl.Trainer(plugins=[plugin], max_steps=50, **trainer_kwargs()).fit(model, loader())
    # scales 4, 2, 1 are not below 1; 0.5, 0.25, 0.125 are: the step at 0.125 stops before its update
    assert plugin.loss_scaler.skipped == 5 and plugin.loss_scaler.get_scale() == 0.125


def test_the_rule_can_be_turned_off():
    plugin = MixedPrecision("bf16-mixed", divergence=False)
    pl.Trainer(plugins=[plugin], max_steps=12, **trainer_kwargs()).fit(TinyRegressor(inf_steps=set(range(100))),
                                                                       loader())
    assert plugin.loss_scaler.skipped == 12
