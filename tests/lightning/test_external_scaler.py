"""A scaler object with ``GradScaler``'s API that is not a ``GradScaler``: used as is, as Lightning uses it."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.plugins.precision import MixedPrecision as NativeMixedPrecision

from lightning_ext import MixedPrecision, MixedPrecisionMonitor
from lightning_ext.loss_scale.external import ExternalScaler, is_external_scaler

from .helpers.models import TinyRegressor, loader, params_of, trainer_kwargs

INF_STEPS = {2, 5}


class CountingScaler:
    """A third-party-style scaler: wraps torch's GradScaler and counts the calls it gets."""

    def __init__(self) -> None:
        self.inner = torch.amp.GradScaler("cpu", init_scale=16.0, growth_interval=3)
        self.calls: dict[str, int] = {"scale": 0, "unscale_": 0, "step": 0, "update": 0}

    def __getattr__(self, name):  # get_scale, state_dict... straight through
        return getattr(self.inner, name)

    def scale(self, outputs):
        self.calls["scale"] += 1
        return self.inner.scale(outputs)

    def unscale_(self, optimizer):
        self.calls["unscale_"] += 1
        return self.inner.unscale_(optimizer)

    def step(self, optimizer, *args, **kwargs):
        self.calls["step"] += 1
        return self.inner.step(optimizer, *args, **kwargs)

    def update(self, new_scale=None):
        self.calls["update"] += 1
        return self.inner.update(new_scale)


def _fit(plugin, **model_kwargs):
    model = TinyRegressor(inf_steps=INF_STEPS, **model_kwargs)
    trainer = pl.Trainer(plugins=[plugin], max_epochs=1, gradient_clip_val=1.0, **trainer_kwargs())
    trainer.fit(model, loader())
    return model, trainer


def test_external_scaler_trains_like_lightnings_plugin_with_it():
    external = CountingScaler()
    assert is_external_scaler(external) and not is_external_scaler(external.inner)
    ours = MixedPrecision("16-mixed", "cpu", scaler=external)
    assert isinstance(ours.loss_scaler, ExternalScaler) and ours.scaler is external  # trainer.scaler as native
    native = NativeMixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu", init_scale=16.0, growth_interval=3))
    native_model, _ = _fit(native)
    our_model, _ = _fit(ours)
    assert our_model.scales == native_model.scales and min(our_model.scales) < 16.0  # the skips backed off
    for name, ref in params_of(native_model).items():
        assert torch.equal(ref, params_of(our_model)[name]), name
    assert external.calls == {"scale": 8, "unscale_": 8, "step": 8, "update": 8}  # once each per step


def test_external_scaler_refusals():
    with pytest.raises(ValueError, match="16-mixed"):
        MixedPrecision("bf16-mixed", scaler=CountingScaler())
    plugin = MixedPrecision("16-mixed", scaler=CountingScaler())
    with pytest.raises(ValueError, match="own loss scaler"):
        plugin.loss_scaler.attach_monitor(MixedPrecisionMonitor())
    fused = torch.optim.Adam([torch.nn.Parameter(torch.ones(2))], fused=True)
    with pytest.raises(RuntimeError, match="does not allow for gradient clipping"):
        plugin.clip_gradients(fused, clip_val=1.0)


def test_own_scaler_clips_with_an_optimizer_that_unscales_in_its_step():
    """Ours unscales before clipping, so a fused Adam trains with clipping (Lightning's plugin refuses it)."""
    model, trainer = _fit(MixedPrecision("16-mixed", "cpu", scaler={"init_scale": 16.0, "growth_interval": 3}),
                          fused=True)
    assert trainer.scaler.skipped == len(INF_STEPS)
    assert all(torch.isfinite(p).all() for p in model.parameters())
