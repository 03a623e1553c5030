"""Regressions: scale at its floor, refit after the user changes weights, policy in checkpoints."""

import lightning.pytorch as pl
import torch
from lx_models import TinyRegressor, loader, trainer_kwargs

from lightning_ext import MixedPrecision
from mp_callbacks.scaler import FLOAT32_TINY


def test_clean_step_at_the_scale_floor_stays_finite():
    # At min_scale 1/scale is still finite, so a clean step applies a finite update.
    model = TinyRegressor(inf_steps={0, 1})
    plugin = MixedPrecision("16-mixed", scaler={"init_scale": 2 * FLOAT32_TINY, "min_scale": FLOAT32_TINY})
    pl.Trainer(plugins=[plugin], max_steps=4, **trainer_kwargs()).fit(model, loader())
    assert plugin.scaler.get_scale() == FLOAT32_TINY
    assert plugin.scaler.skipped == 2
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_refit_uses_the_weights_the_user_set_not_stale_masters():
    model = TinyRegressor()
    plugin = MixedPrecision("bf16-master")
    pl.Trainer(plugins=[plugin], max_steps=2, **trainer_kwargs()).fit(model, loader())
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(0.5)
    plugin_masters_before = {k: v.clone() for k, v in plugin.master_state_dict().items()}
    trainer = pl.Trainer(plugins=[plugin], max_steps=1, **trainer_kwargs())
    model.lr = 0.0  # no movement: the weights must stay the user's 0.5
    trainer.fit(model, loader())
    for name, p in model.named_parameters():
        assert torch.all(p.float() == 0.5), name
    assert any(not torch.equal(v, plugin.master_state_dict()[k]) for k, v in plugin_masters_before.items())


def test_checkpointed_fp32_rule_is_restored(tmp_path):
    model = TinyRegressor(norm=True)
    plugin = MixedPrecision("16-mixed")
    trainer = pl.Trainer(plugins=[plugin], max_steps=2, **trainer_kwargs())
    trainer.fit(model, loader())
    plugin.keep_in_fp32("net.0")
    path = tmp_path / "k.ckpt"
    trainer.save_checkpoint(path)
    fresh = MixedPrecision("16-mixed")
    model2 = TinyRegressor(norm=True)
    pl.Trainer(plugins=[fresh], max_steps=3, **trainer_kwargs()).fit(model2, loader(), ckpt_path=path)
    assert ("net.0", "float32") in fresh.policy.module_rules
