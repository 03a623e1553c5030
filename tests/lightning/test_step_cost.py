"""What a step does and holds: the overflow check only when it decides or is asked for,
and ``*-master`` weights released while the optimizer updates the masters."""

import lightning.pytorch as pl
import pytest
import torch

from lightning_ext import MixedPrecision, MixedPrecisionMonitor
from mp_callbacks.app.lightning_runner import state_bytes
from mp_callbacks.memory import bytes_per_param
from tests.lightning.helpers.models import TinyRegressor, loader, trainer_kwargs


@pytest.fixture
def every_finite_check(monkeypatch):
    """Counts every way torch looks for inf/NaN: the fused kernel, isfinite/isinf/isnan (functions and methods)."""
    calls = []

    def counting(original):
        def wrapper(*args, **kwargs):
            calls.append(original.__name__)
            return original(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(torch, "_amp_foreach_non_finite_check_and_unscale_",
                        counting(torch._amp_foreach_non_finite_check_and_unscale_))
    for name in ("isfinite", "isinf", "isnan"):
        monkeypatch.setattr(torch, name, counting(getattr(torch, name)))
        monkeypatch.setattr(torch.Tensor, name, counting(getattr(torch.Tensor, name)))
    return calls


@pytest.fixture
def check_calls(monkeypatch):
    """Counts calls of torch's fused non-finite check (what the plugin uses to look at gradients)."""
    calls = []
    original = torch._amp_foreach_non_finite_check_and_unscale_

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(torch, "_amp_foreach_non_finite_check_and_unscale_", counting)
    return calls


NO_SKIP = {"enabled": False, "skip_nonfinite": False}  # the opt-out: apply every step, look at nothing


@pytest.mark.parametrize("recipe", ["bf16-mixed", "bf16-master", "32-true"])
def test_scaling_off_still_skips_nonfinite_steps_by_default(recipe, check_calls):
    plugin = MixedPrecision(recipe)
    assert plugin.scaler is None and plugin.checks_overflow is True and plugin.can_skip
    model = TinyRegressor(inf_steps={2})
    pl.Trainer(plugins=[plugin], max_steps=5, **trainer_kwargs()).fit(model, loader())
    assert len(check_calls) == 5  # one fused check per step (the model's gradients: one device, one dtype)
    view = plugin.loss_scaler
    assert (view.steps, view.overflows, view.skipped) == (5, 1, 1)  # the inf step was skipped
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("recipe", ["bf16-mixed", "bf16-master", "32-true"])
def test_opting_out_does_not_look_at_gradients(recipe, every_finite_check):
    plugin = MixedPrecision(recipe, scaler=NO_SKIP, divergence=False)
    assert plugin.checks_overflow is False and not plugin.can_skip
    model = TinyRegressor(inf_steps={2})
    pl.Trainer(plugins=[plugin], max_steps=5, **trainer_kwargs()).fit(model, loader())
    assert every_finite_check == []
    view = plugin.loss_scaler
    assert (view.steps, view.overflows, view.skipped) == (5, 0, 0)  # the inf step was applied, not counted


@pytest.mark.parametrize("recipe", ["bf16-mixed", "bf16-master"])
def test_opted_out_counts_overflows_on_request(recipe, check_calls):
    plugin = MixedPrecision(recipe, scaler=NO_SKIP, count_overflows=True, divergence=False)
    assert plugin.checks_overflow is True
    model = TinyRegressor(inf_steps={2})
    pl.Trainer(plugins=[plugin], max_steps=5, **trainer_kwargs()).fit(model, loader())
    assert len(check_calls) == 5
    # Step 2 applies inf/NaN gradients: the weights turn NaN and every later step overflows too.
    assert (plugin.loss_scaler.steps, plugin.loss_scaler.overflows, plugin.loss_scaler.skipped) == (5, 3, 0)


def test_an_attached_monitor_turns_the_count_on_and_off(check_calls):
    plugin = MixedPrecision("bf16-mixed", scaler=NO_SKIP)
    monitor = MixedPrecisionMonitor(log_every_n_steps=1, measure_swamping=False, log_memory=False)
    model = TinyRegressor(inf_steps={3})
    seen = []

    class Probe(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            seen.append(plugin.checks_overflow)

    pl.Trainer(plugins=[plugin], callbacks=[monitor, Probe()], max_steps=4, **trainer_kwargs()).fit(
        model, loader())
    assert seen == [True] * 4 and len(check_calls) == 4
    assert plugin.loss_scaler.overflows == 1 and monitor.history[-1].overflows_total == 1
    assert plugin.loss_scaler.monitored is False and plugin.checks_overflow is False  # detached at teardown


def test_count_overflows_must_be_a_bool_or_none():
    with pytest.raises(TypeError, match="count_overflows"):
        MixedPrecision("bf16-mixed", count_overflows="yes")


def test_scaling_on_always_checks(check_calls):
    plugin = MixedPrecision("16-mixed", count_overflows=False)
    assert plugin.checks_overflow is True
    pl.Trainer(plugins=[plugin], max_steps=3, **trainer_kwargs()).fit(TinyRegressor(inf_steps={1}), loader())
    assert len(check_calls) == 3 and plugin.loss_scaler.skipped == plugin.loss_scaler.overflows >= 1


class _Watch(pl.Callback):
    """Records, inside every ``optimizer.step()``, the bytes the low-precision weights hold and the state."""

    def __init__(self):
        self.weight_bytes, self.state = [], []

    def on_train_start(self, trainer, pl_module):
        def pre(optimizer, args, kwargs):
            lows = [p for p in pl_module.parameters() if p.dtype == torch.bfloat16]
            self.weight_bytes.append(sum(p.untyped_storage().nbytes() for p in lows))
            self.state.append(state_bytes(pl_module, optimizer))

        trainer.optimizers[0].register_step_pre_hook(pre)


def _adamw_model():
    return TinyRegressor(optimizer="adamw", dim=32, hidden=64)


def test_master_weights_are_released_during_the_step_and_rebuilt():
    plugin = MixedPrecision("bf16-master")
    model, watch = _adamw_model(), _Watch()
    pl.Trainer(plugins=[plugin], callbacks=[watch], max_steps=4, **trainer_kwargs()).fit(model, loader(dim=32))
    assert watch.weight_bytes == [0, 0, 0, 0]
    masters = plugin.master_state_dict()
    for name, p in model.named_parameters():
        assert p.dtype == torch.bfloat16 and p.untyped_storage().nbytes() == p.numel() * 2
        assert torch.equal(p, masters[name].to(torch.bfloat16)), name
    n = sum(p.numel() for p in model.parameters())
    # At the step: FP32 grads 4 + masters 4 + Adam m, v 8 (first step: no slots yet).
    assert watch.state[-1] == 16 * n


def test_releasing_can_be_turned_off():
    plugin = MixedPrecision("bf16-master", free_weights_during_step=False)
    model, watch = _adamw_model(), _Watch()
    pl.Trainer(plugins=[plugin], callbacks=[watch], max_steps=2, **trainer_kwargs()).fit(model, loader(dim=32))
    n = sum(p.numel() for p in model.parameters())
    assert watch.weight_bytes == [2 * n, 2 * n] and watch.state[-1] == 18 * n


def test_weights_come_back_when_the_optimizer_step_fails():
    plugin = MixedPrecision("bf16-master")
    model = _adamw_model()

    class Boom(pl.Callback):
        def on_train_start(self, trainer, pl_module):
            def pre(optimizer, args, kwargs):
                if trainer.global_step == 2:
                    raise RuntimeError("optimizer failed")
            trainer.optimizers[0].register_step_pre_hook(pre)

    with pytest.raises(RuntimeError, match="optimizer failed"):
        pl.Trainer(plugins=[plugin], callbacks=[Boom()], max_steps=4, **trainer_kwargs()).fit(model, loader(dim=32))
    masters = plugin.master_state_dict()
    for name, p in model.named_parameters():
        assert p.untyped_storage().nbytes() == p.numel() * 2
        assert torch.equal(p, masters[name].to(torch.bfloat16)), name


def test_runner_takes_an_optimizer_factory():
    from mp_callbacks.app.compare import RunSpec
    from mp_callbacks.app.lightning_runner import fit_once

    made = []

    def sgd(params, lr):
        made.append(lr)
        return torch.optim.SGD(params, lr=lr)

    spec = RunSpec(steps=3, batch_size=32, hidden=16, depth=1)
    module, recorder = fit_once(MixedPrecision("bf16-master"), spec, optimizer=sgd)
    assert made == [spec.lr] and len(recorder.times) == 3
    assert isinstance(module.configure_optimizers(), torch.optim.SGD)


def test_bytes_at_the_end_of_backward_and_after_the_grad_copy():
    """bf16-master + AdamW: 16 B/param at the end of the backward (bf16 weights and grads, FP32 masters and
    m, v), 18 right after the grads move onto the masters (FP32 grads while the bf16 weights are still held:
    the estimator's figure with the weights kept), 16 inside the step (weights released)."""
    plugin = MixedPrecision("bf16-master")
    model = _adamw_model()
    after_backward, after_copy = [], []
    original = plugin.masters.grads_to_masters

    def copying(entries):
        original(entries)
        after_copy.append(state_bytes(model, trainer.optimizers[0]))

    plugin.masters.grads_to_masters = copying

    class Backward(pl.Callback):
        def on_after_backward(self, trainer, pl_module):
            after_backward.append(state_bytes(pl_module, trainer.optimizers[0]))

    watch = _Watch()
    trainer = pl.Trainer(plugins=[plugin], callbacks=[Backward(), watch], max_steps=3, **trainer_kwargs())
    trainer.fit(model, loader(dim=32))
    n = sum(p.numel() for p in model.parameters())
    assert after_backward[1:] == [16 * n, 16 * n]  # from the second step on the Adam slots exist
    assert after_copy[1:] == [18 * n, 18 * n] and watch.state[1:] == [16 * n, 16 * n]
    assert bytes_per_param(plugin.recipe.master, "adamw", fp32_master_grads=True) == 18.0
