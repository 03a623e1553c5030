"""``*-master``: the masters' optimizer step runs torch's fused kernel where the user left the choice to torch."""

import lightning.pytorch as pl
import pytest
import torch

from lightning_ext import MixedPrecision, master_native
from lightning_ext.fused_step import fusable_groups, fused_implementation
from tests.lightning.helpers.models import TinyRegressor, loader, trainer_kwargs


@pytest.fixture
def kernel_calls(monkeypatch):
    """Counts calls of torch's fused AdamW/Adam/SGD kernels (the widened path: the one-pass step, which
    takes the kernel's place, is off; tests/lightning/test_master_native.py covers it)."""
    monkeypatch.setattr(master_native, "NATIVE", False)
    calls = []
    for name in ("_fused_adamw_", "_fused_adam_", "_fused_sgd_"):
        original = getattr(torch, name)

        def counting(*args, _name=name, _original=original, **kwargs):
            calls.append(_name)
            return _original(*args, **kwargs)

        monkeypatch.setattr(torch, name, counting)
    return calls


class _Model(TinyRegressor):
    def __init__(self, make_optimizer):
        super().__init__(dim=32, hidden=64)
        self.make_optimizer = make_optimizer

    def configure_optimizers(self):
        return self.make_optimizer(self.parameters())


def _fit(recipe, make_optimizer, steps=4, fused_step=True, **plugin_kwargs):
    plugin = MixedPrecision(recipe, **plugin_kwargs)
    if plugin.masters is not None:
        plugin.masters.fused_step = fused_step
    model = _Model(make_optimizer)
    trainer = pl.Trainer(plugins=[plugin], max_steps=steps, **trainer_kwargs())
    trainer.fit(model, loader(dim=32))
    return plugin, model, trainer.optimizers[0]


ADAMW = lambda params: torch.optim.AdamW(params, lr=1e-2)  # noqa: E731


def test_bf16_master_steps_the_masters_with_the_fused_kernel(kernel_calls):
    plugin, model, opt = _fit("bf16-master", ADAMW)
    assert kernel_calls == ["_fused_adamw_"] * 4
    assert all(g["fused"] is None for g in opt.param_groups)  # the user's setting is back
    assert all(g["fused"] is None for g in opt.state_dict()["param_groups"])
    masters = plugin.master_state_dict()
    for name, p in model.named_parameters():  # the weights are the rounded masters
        assert p.dtype == torch.bfloat16 and torch.equal(p, masters[name].to(torch.bfloat16)), name


def test_same_update_as_torchs_default_up_to_fp32_rounding(kernel_calls):
    fused, _, opt_f = _fit("bf16-master", ADAMW, steps=6)
    plain, _, opt_p = _fit("bf16-master", ADAMW, steps=6, fused_step=False)  # torch's single-tensor loop
    assert kernel_calls == ["_fused_adamw_"] * 6
    plain_masters = plain.master_state_dict()
    for name, m in fused.master_state_dict().items():
        torch.testing.assert_close(m, plain_masters[name], rtol=1e-5, atol=1e-6)
    for p_f, p_p in zip(opt_f.param_groups[0]["params"], opt_p.param_groups[0]["params"]):
        torch.testing.assert_close(opt_f.state[p_f]["exp_avg_sq"], opt_p.state[p_p]["exp_avg_sq"], rtol=1e-5, atol=0)
        assert float(opt_f.state[p_f]["step"]) == float(opt_p.state[p_p]["step"]) == 6


@pytest.mark.parametrize("make", [
    lambda params: torch.optim.AdamW(params, lr=1e-2, foreach=False),
    lambda params: torch.optim.AdamW(params, lr=1e-2, foreach=True),
    lambda params: torch.optim.AdamW(params, lr=1e-2, fused=False),
    lambda params: type("MyAdamW", (torch.optim.AdamW,), {})(params, lr=1e-2),  # may override step
], ids=["foreach-False", "foreach-True", "fused-False", "subclass"])
def test_an_explicit_choice_or_a_subclass_is_left_alone(make, kernel_calls):
    _fit("bf16-master", make)
    assert kernel_calls == []


def test_sgd_with_momentum_and_the_fp32_recipes(kernel_calls):
    plugin, _, _ = _fit("16-master", lambda params: torch.optim.SGD(params, lr=1e-2, momentum=0.9), steps=3,
                        scaler={"init_scale": 4.0})  # the torch preset's 2**16 overflows here: nothing would step
    assert plugin.loss_scaler.skipped == 0 and kernel_calls == ["_fused_sgd_"] * 3
    kernel_calls.clear()
    _fit("bf16-mixed", ADAMW, steps=3)  # FP32 params: the user's optimizer as configured (torch's default)
    assert kernel_calls == []


def test_the_flag_is_restored_when_the_step_raises():
    p = torch.nn.Parameter(torch.ones(4))
    p.grad = torch.ones(4)
    opt = torch.optim.AdamW([p], lr=0.1)
    assert fusable_groups(opt) == opt.param_groups
    with pytest.raises(RuntimeError, match="boom"):
        with fused_implementation(opt) as fused:
            assert fused and opt.param_groups[0]["fused"] is True
            raise RuntimeError("boom")
    assert opt.param_groups[0]["fused"] is None
    p.grad = p.grad.to_sparse()
    assert fusable_groups(opt) == []  # sparse gradients have no fused kernel


def test_only_dense_fp32_with_the_step_count_on_the_parameters_device_is_fused():
    p = torch.nn.Parameter(torch.ones(4))
    p.grad = torch.ones(4)
    opt = torch.optim.AdamW([p], lr=0.1)
    opt.state[p] = {"step": torch.zeros(())}  # on the CPU, with the parameter: fused
    assert fusable_groups(opt) == opt.param_groups
    opt.state[p] = {"step": torch.zeros((), device="meta")}  # another device than the parameter's
    assert fusable_groups(opt) == []
    opt.state[p] = {"step": 3.0}  # a plain number (an old checkpoint): fused
    assert fusable_groups(opt) == opt.param_groups
    p.grad = None  # no gradient in the group: nothing to fuse
    assert fusable_groups(opt) == []
    q = torch.nn.Parameter(torch.ones(4, dtype=torch.float64))
    q.grad = torch.ones(4, dtype=torch.float64)
    assert fusable_groups(torch.optim.AdamW([q], lr=0.1)) == []  # FP32 only
