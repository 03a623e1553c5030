"""``16-mixed`` with the torch preset is bit-identical to Lightning's native AMP plugin."""

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.plugins.precision import MixedPrecision as NativeMixedPrecision
from lx_models import TinyRegressor, loader, params_of, trainer_kwargs

from lightning_ext import MixedPrecision

INF_STEPS = {2, 3, 9, 15}  # backoffs; growth_interval=3 makes the scale grow in between


def _fit(plugin, **model_kwargs):
    model = TinyRegressor(inf_steps=INF_STEPS, **model_kwargs)
    trainer = pl.Trainer(plugins=[plugin], max_epochs=3, **trainer_kwargs())
    trainer.fit(model, loader())
    return model, trainer


def _native():
    return NativeMixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu", init_scale=16.0, growth_interval=3))


@pytest.mark.parametrize("scaler", ["gradscaler", "config"])
def test_16_mixed_matches_native_bit_for_bit(scaler):
    if scaler == "gradscaler":
        ours = MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu", init_scale=16.0, growth_interval=3))
    else:
        ours = MixedPrecision("16-mixed", "cpu", scaler={"init_scale": 16.0, "growth_interval": 3})
    native_model, native_trainer = _fit(_native())
    our_model, our_trainer = _fit(ours)

    # Same loss-scale trajectory => the same skip/backoff/growth decisions at every step.
    assert our_model.scales == native_model.scales
    assert 4.0 in our_model.scales and 16.0 in our_model.scales[10:]  # backoff and growth both happened
    # Bit-identical parameters.
    ref, got = params_of(native_model), params_of(our_model)
    assert ref.keys() == got.keys()
    for name in ref:
        assert torch.equal(ref[name], got[name]), name
    # Same number of applied Adam updates (skips are skipped in both).
    ref_steps = {int(s["step"]) for s in native_trainer.optimizers[0].state.values()}
    got_steps = {int(s["step"]) for s in our_trainer.optimizers[0].state.values()}
    assert ref_steps == got_steps == {24 - len(INF_STEPS)}
    scaler_view = our_trainer.scaler
    assert (scaler_view.steps, scaler_view.skipped, scaler_view.overflows) == (24, 4, 4)
    assert scaler_view.growths >= 2
    assert scaler_view.get_scale() == native_trainer.scaler.get_scale()


def test_32_true_matches_plain_trainer():
    """With scaling off and no autocast the plugin is an FP32 pass-through."""
    ref_model = TinyRegressor(optimizer="sgd")
    pl.Trainer(max_epochs=1, **trainer_kwargs()).fit(ref_model, loader())
    model = TinyRegressor(optimizer="sgd")
    trainer = pl.Trainer(plugins=[MixedPrecision("32-true")], max_epochs=1, **trainer_kwargs())
    trainer.fit(model, loader())
    for (name, a), b in zip(params_of(ref_model).items(), params_of(model).values()):
        assert torch.equal(a, b), name
    assert trainer.scaler is None and trainer.precision_plugin.loss_scaler.steps == 8
