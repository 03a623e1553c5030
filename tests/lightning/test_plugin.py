"""The plugin: clear errors, constructor coercions, TorchOps == the NumPy reference, the scaler it exposes,
and bit-identity with Lightning's native AMP plugin under ``16-mixed``."""

import random

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from lightning.pytorch.plugins.precision import MixedPrecision as NativeMixedPrecision
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_ext import MixedPrecision, TorchOps, check_strategy
from mp_callbacks import RecipeError, ScaleFloorError, ScalerConfig, initial_state, next_state
from mp_callbacks.loss_scale import FLOAT32_TINY, state_to_dict
from tests.lightning.helpers.models import TinyRegressor, loader, params_of, trainer_kwargs


def test_bad_recipe_names_list_the_valid_ones():
    with pytest.raises(RecipeError, match="valid recipes: 32-true, 16-mixed, bf16-mixed, 16-master, bf16-master"):
        MixedPrecision("int8-mixed")
    with pytest.raises(RecipeError, match="did you mean 'bf16-master'.*Trainer\\(precision='bf16-true'\\)"):
        MixedPrecision("bf16-true")
    # Lightning's own plugin refuses "16"; so do we, naming the recipe meant. No suggestion is a fake recipe.
    for name, meant in [("16", "16-mixed"), ("fp16", "16-mixed"), ("bf16", "bf16-mixed"), ("64-true", "32-true")]:
        with pytest.raises(ValueError, match=f"did you mean '{meant}'"):
            MixedPrecision(name)
    with pytest.raises(ValueError, match="unknown scaler preset"):
        MixedPrecision("16-mixed", scaler="nope")


def test_aliases_and_scaler_sources():
    assert MixedPrecision("mixed_float16").precision == "16-mixed"
    assert MixedPrecision("mixed_bfloat16").precision == "bf16-mixed"
    gs = torch.amp.GradScaler("cpu", init_scale=128.0, growth_factor=4.0, backoff_factor=0.25, growth_interval=7)
    cfg = MixedPrecision("16-mixed", scaler=gs).recipe.scaler
    assert (cfg.init_scale, cfg.growth_factor, cfg.backoff_factor, cfg.growth_interval) == (128.0, 4.0, 0.25, 7)
    assert MixedPrecision("16-mixed", scaler="megatron").recipe.scaler == ScalerConfig.preset("megatron")
    assert MixedPrecision("bf16-mixed").scaler is None  # as native: nothing is scaled
    assert not MixedPrecision("bf16-mixed").loss_scaler.is_enabled()
    assert MixedPrecision("bf16-master", scaler="torch").scaler.is_enabled()  # opt-in scaling for bf16
    assert MixedPrecision("16-mixed", scaler=torch.amp.GradScaler("cpu", enabled=False)).scaler is None


@pytest.mark.parametrize("recipe", ["16-mixed", "bf16-master"])
def test_lbfgs_is_rejected_with_the_alternative(recipe):
    trainer = pl.Trainer(plugins=[MixedPrecision(recipe)], max_steps=1, **trainer_kwargs())
    with pytest.raises(MisconfigurationException, match="LBFGS.*first-order optimizer.*32-true"):
        trainer.fit(TinyRegressor(optimizer="lbfgs"), loader())


def test_lbfgs_runs_under_32_true():
    model = TinyRegressor(optimizer="lbfgs", lr=0.1)
    trainer = pl.Trainer(plugins=[MixedPrecision("32-true")], max_steps=2, **trainer_kwargs())
    trainer.fit(model, loader())
    assert trainer.global_step == 2


def test_unsupported_strategies_are_refused_through_the_trainer():
    from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, ModelParallelStrategy

    check_strategy(ModelParallelStrategy())  # FSDP2: supported (tests/lightning/test_scale_out.py)

    class DeepSpeedStrategy(DDPStrategy):  # stands in for lightning's (deepspeed is not installed)
        pass

    trainer = pl.Trainer(plugins=[MixedPrecision("16-mixed")], strategy=DeepSpeedStrategy(), max_steps=1,
                         **trainer_kwargs())
    try:
        with pytest.raises(MisconfigurationException, match="DeepSpeedStrategy.*DeepSpeed's own fp16/bf16"):
            trainer.fit(TinyRegressor(), loader())
    finally:  # the refused fit leaves its 1-rank process group behind: later DDP tests fork from this process
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    # FSDP (FSDP1) refuses the CPU itself; the plugin's message is checked on the object
    with pytest.raises(MisconfigurationException, match="FSDPStrategy.*FSDPMixedPrecision.*precision='bf16-mixed'"):
        check_strategy(FSDPStrategy())


def test_scale_floor_raise_names_step_and_scale():
    plugin = MixedPrecision("16-mixed", scaler={"init_scale": 2.0, "min_scale": 1.0, "on_min_scale": "raise"})
    trainer = pl.Trainer(plugins=[plugin], max_steps=6, **trainer_kwargs())
    with pytest.raises(ScaleFloorError, match="step 2 .*scale=1"):
        trainer.fit(TinyRegressor(inf_steps={0, 1, 2}), loader())


def test_torch_ops_match_the_numpy_reference():
    ops = TorchOps("cpu")
    configs = [
        ScalerConfig.preset("torch", growth_interval=3),
        ScalerConfig.preset("megatron", growth_interval=2),
        ScalerConfig(init_scale=4.0, min_scale=1.0, max_scale=64.0, growth_interval=2, hysteresis=2,
                     consecutive_hysteresis=True),
        ScalerConfig(init_scale=2.0**-125, growth_interval=1),
        ScalerConfig(enabled=False),
        ScalerConfig(dynamic=False),
    ]
    for cfg in configs:
        ref, got = initial_state(cfg), initial_state(cfg, ops)
        rng = random.Random(0)
        for _ in range(200):
            flag = rng.random() < 0.35
            ref, ref_applied = next_state(cfg, ref, flag)
            got, got_applied = next_state(cfg, got, torch.tensor(flag), ops)
            assert state_to_dict(ref) == state_to_dict(got)
            assert bool(ref_applied) == bool(got_applied)
            assert got.scale.dtype == torch.float32 and got.steps.dtype == torch.int32
            assert np.float32(ref.scale).tobytes() == got.scale.numpy().tobytes()


def test_scaler_view_and_latest_stats():
    plugin = MixedPrecision("16-mixed", scaler={"init_scale": 2.0**4})
    assert plugin.latest_stats() == {}
    trainer = pl.Trainer(plugins=[plugin], max_steps=3, **trainer_kwargs())
    trainer.fit(TinyRegressor(inf_steps={2}), loader())
    assert trainer.scaler is plugin.scaler
    stats = plugin.scaler.latest()
    assert bool(stats["overflow"]) and not bool(stats["applied"])
    assert float(stats["scale"]) == 16.0 and float(stats["next_scale"]) == 8.0
    assert all(isinstance(v, torch.Tensor) and v.dim() == 0 for v in stats.values())
    assert (plugin.scaler.steps, plugin.scaler.skipped, plugin.scaler.overflows, plugin.scaler.growths) == (3, 1, 1, 0)
    assert plugin.scaler.get_scale() == 8.0 and plugin.last_step_skipped()


# ------------------------------------------------------------ against the native plugin
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


OPTIMIZERS = {
    "adamw, two groups": lambda m: torch.optim.AdamW([
        {"params": m.net[0].parameters(), "weight_decay": 0.1},
        {"params": m.net[-1].parameters(), "weight_decay": 0.0, "lr": 3e-3}], lr=1e-2),
    "adam, L2 decay, beta1 0.3": lambda m: torch.optim.Adam(m.parameters(), lr=1e-2, betas=(0.3, 0.99),
                                                            weight_decay=0.05),
    "adamw, fused": lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True),
    "sgd, momentum": lambda m: torch.optim.SGD(m.parameters(), lr=1e-2, momentum=0.9),
}


class _WithOptimizer(TinyRegressor):
    def __init__(self, make_optimizer, **kwargs):
        super().__init__(dim=37, hidden=45, **kwargs)
        self.make_optimizer = make_optimizer

    def configure_optimizers(self):
        return self.make_optimizer(self)


@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
def test_32_true_is_lightnings_own_32_true_bit_for_bit(opt):
    """The user's optimizer runs as torch wrote it: Lightning's own 32-true Trainer's weights, optimizer state
    and version counters (everything written in place alike)."""
    def fit(plugins, precision):
        model = _WithOptimizer(OPTIMIZERS[opt])
        trainer = pl.Trainer(plugins=plugins, max_steps=6, **trainer_kwargs(**precision))
        trainer.fit(model, loader(dim=37))
        return model, trainer.optimizers[0]

    (model_a, opt_a), (model_b, opt_b) = fit([MixedPrecision("32-true")], {}), fit([], {"precision": "32-true"})
    for (name, p), q in zip(model_a.named_parameters(), model_b.parameters(), strict=True):
        assert torch.equal(p.view(torch.int32), q.view(torch.int32)) and p._version == q._version, name
    for sa, sb in zip(opt_a.state.values(), opt_b.state.values(), strict=True):
        assert sa.keys() == sb.keys()
        for k in sa:
            assert sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]) and sa[k]._version == sb[k]._version, k


def test_clean_step_at_the_scale_floor_stays_finite():
    # At min_scale 1/scale is still finite, so a clean step applies a finite update.
    model = TinyRegressor(inf_steps={0, 1})
    plugin = MixedPrecision("16-mixed", scaler={"init_scale": 2 * FLOAT32_TINY, "min_scale": FLOAT32_TINY})
    pl.Trainer(plugins=[plugin], max_steps=4, **trainer_kwargs()).fit(model, loader())
    assert plugin.scaler.get_scale() == FLOAT32_TINY
    assert plugin.scaler.skipped == 2
    assert all(torch.isfinite(p).all() for p in model.parameters())
