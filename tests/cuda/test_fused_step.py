"""The fused ``*-master`` step on CUDA: torch's AdamW on FP32 parameters given the same gradients.

The plugin steps the FP32 masters with torch's fused AdamW kernel (``_fused_adamw_``) where the user
left ``foreach``/``fused`` unset.  Fed the gradients the masters received (captured in a step
pre-hook), an FP32 copy of the masters stepped by ``AdamW(fused=True)`` ends bit for bit where the
masters do, and one stepped by torch's default AdamW (foreach on CUDA) within FP32 rounding.

CPU counterpart: tests/lightning/test_fused_step.py.
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch

from lightning_ext import MixedPrecision
from tests.cuda.helpers import DEVICE, Net, cuda_only, fit

pytestmark = cuda_only

STEPS = 6
LR = 1e-2


@pytest.fixture
def fused_calls(monkeypatch):
    """The device type of the first parameter of every ``torch._fused_adamw_`` call."""
    calls: list[str] = []
    original = torch._fused_adamw_

    def counting(params, *args, **kwargs):
        calls.append(params[0].device.type)
        return original(params, *args, **kwargs)

    monkeypatch.setattr(torch, "_fused_adamw_", counting)
    return calls


class _Capture(pl.Callback):
    """Per applied step: the optimizer's parameters (the masters) before the step, their gradients,
    and the parameters after it."""

    def __init__(self) -> None:
        self.before: list[list[torch.Tensor]] = []
        self.grads: list[list[torch.Tensor]] = []
        self.after: list[list[torch.Tensor]] = []

    def on_train_start(self, trainer, pl_module) -> None:
        opt = trainer.optimizers[0]

        def params():
            return [p for g in opt.param_groups for p in g["params"]]

        def pre(optimizer, args, kwargs):
            self.before.append([p.detach().clone() for p in params()])
            self.grads.append([p.grad.detach().clone() for p in params()])

        def post(optimizer, args, kwargs):
            self.after.append([p.detach().clone() for p in params()])

        opt.register_step_pre_hook(pre)
        opt.register_step_post_hook(post)


def _replay(capture: _Capture, **adamw) -> list[list[torch.Tensor]]:
    """FP32 copies of the first step's parameters stepped by ``AdamW(**adamw)`` with the captured grads."""
    ref = [torch.nn.Parameter(p.clone()) for p in capture.before[0]]
    opt = torch.optim.AdamW(ref, lr=LR, **adamw)
    out = []
    for grads in capture.grads:
        for p, g in zip(ref, grads, strict=True):
            p.grad = g.clone()
        opt.step()
        out.append([p.detach().clone() for p in ref])
    return out


@pytest.mark.parametrize("recipe", ["bf16-master", "16-master", "fp8-mixed"])
def test_the_fused_master_step_is_torchs_adamw_on_fp32_params(recipe, fused_calls):
    capture = _Capture()
    plugin = MixedPrecision(recipe, device=DEVICE, scaler={"init_scale": 2.0**8} if recipe.startswith("16") else None)
    model = Net(lr=LR)
    fit(plugin, model, steps=STEPS, callbacks=[capture])
    assert plugin.loss_scaler.skipped == 0 and len(capture.after) == STEPS
    assert fused_calls == [DEVICE] * STEPS  # one fused kernel call per step, on the training device
    assert all(p.dtype == torch.float32 and p.device.type == DEVICE for p in capture.before[0])
    fused = _replay(capture, fused=True)
    for t, (got, want) in enumerate(zip(capture.after, fused, strict=True)):
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            assert torch.equal(a, b), (t, i)
    default = _replay(capture)  # torch's default implementation (foreach on CUDA)
    for t, (got, want) in enumerate(zip(capture.after, default, strict=True)):
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m, t=t: f"step {t}: {m}")
    masters = plugin.master_state_dict()
    for name, p in model.named_parameters():  # the weights are the rounded masters
        if name in masters:
            assert p.dtype != torch.float32 and torch.equal(p, masters[name].to(p.dtype)), name
