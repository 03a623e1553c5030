"""Every recipe trains on CUDA under the Lightning plugin; an injected inf skips the step, nothing changes.

CPU counterparts: tests/lightning/test_plugin.py (training), test_skip_semantics.py (the skip).
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch

from lightning_ext import MixedPrecision
from mp_callbacks import RECIPE_NAMES
from tests.cuda.helpers import DEVICE, ON_CUDA, Net, cuda_only, fit

pytestmark = cuda_only

LOW = {"16-mixed": torch.float32, "bf16-mixed": torch.float32, "32-true": torch.float32,
       "16-master": torch.float16, "bf16-master": torch.bfloat16, "bf16-kahan": torch.bfloat16,
       "bf16-sr": torch.bfloat16, "fp8-mixed": torch.bfloat16}
"""The storage dtype of the Linear weights under each recipe (LayerNorm stays FP32 everywhere)."""


def test_every_recipe_is_covered():
    assert set(RECIPE_NAMES) <= set(LOW), sorted(set(RECIPE_NAMES) - set(LOW))


@pytest.mark.parametrize("recipe", sorted(LOW))
def test_every_recipe_trains_a_few_steps(recipe):
    plugin = MixedPrecision(recipe, device=DEVICE)
    model = Net()
    before = [p.detach().float().cpu().clone() for p in model.parameters()]
    trainer = fit(plugin, model, steps=24)
    losses = torch.stack(model.losses).float().cpu()
    assert torch.isfinite(losses).all(), losses
    assert losses[-8:].mean() < losses[:8].mean(), losses  # 3 epochs over the same 8 batches: it learns
    params = list(model.parameters())
    assert all(p.device.type == DEVICE for p in params)
    assert model.net[0].weight.dtype == LOW[recipe] and model.net[1].weight.dtype == torch.float32
    assert all(not torch.equal(b, p.detach().float().cpu()) for b, p in zip(before, params, strict=True))
    scaler = plugin.loss_scaler
    assert scaler.state.scale.device.type == DEVICE  # the scaler's state lives on the training device
    assert scaler.steps == 24
    # fp16 starts at the torch preset's 2**16 and may back off a few times first; nothing else skips
    assert scaler.skipped <= (3 if recipe.startswith("16") else 0), scaler.skipped
    opt = trainer.optimizers[0]
    stepped = [p for g in opt.param_groups for p in g["params"]]
    assert all(p.device.type == DEVICE and p.dtype == (torch.float32 if plugin.master_weights else p.dtype)
               for p in stepped)  # *-master: the optimizer holds the FP32 masters, on the device
    assert all(v.device.type == DEVICE for s in opt.state.values() for v in s.values()
               if torch.is_tensor(v) and v.dim())
    if plugin.fp8 is not None:
        assert plugin.fp8.names == ["net.0", "net.3", "net.5"]
        assert plugin.fp8.states["inputs"].scale.device.type == DEVICE


class Snapshots(pl.Callback):
    """After every batch: everything a step may change (params, masters, every optimizer state tensor
    and step count, LR, compensation buffers, the rounding stream, FP8 states, the scale)."""

    def __init__(self) -> None:
        self.rows: list[dict] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        plugin = trainer.precision_plugin
        opt = trainer.optimizers[0]
        params = [p for g in opt.param_groups for p in g["params"]]
        row = {
            "params": [p.detach().clone() for p in pl_module.parameters()],
            "masters": [m.clone() for m in plugin.master_state_dict().values()],
            "state": [v.clone() for p in params for v in opt.state.get(p, {}).values() if torch.is_tensor(v)],
            "lr": opt.param_groups[0]["lr"],
            "scale": plugin.loss_scaler.get_scale(),
            "buffers": [b.clone() for b in plugin.rounding.buffers()] if plugin.rounding is not None else [],
            "stream": repr(plugin.rounding.stream) if plugin.rounding is not None else None,
            "fp8": ([t.clone() for s in plugin.fp8.states.values() for t in s]
                    if plugin.fp8 is not None and plugin.fp8.states is not None else []),
        }
        self.rows.append(row)


def _same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


SKIP = {2, 5}


@pytest.mark.parametrize("recipe", sorted(LOW))
def test_an_injected_inf_is_skipped_and_nothing_changes(recipe):
    snaps = Snapshots()
    plugin = MixedPrecision(recipe, device=DEVICE, scaler={"init_scale": 2.0**8} if recipe.startswith("16") else None)
    model = Net(inf_steps=SKIP, scheduler=True)
    fit(plugin, model, steps=8, callbacks=[snaps])
    rows = snaps.rows
    assert len(rows) == 8
    for k in range(1, 8):
        before, after = rows[k - 1], rows[k]
        if k in SKIP:
            for field in ("params", "masters", "state", "buffers", "fp8"):
                assert _same(before[field], after[field]), (k, field)
            assert after["stream"] == before["stream"], k
            assert after["lr"] == before["lr"], k  # the step-interval LR scheduler did not advance
            if plugin.scaler is not None:  # 16-*: the scale backs off
                assert after["scale"] == before["scale"] / 2, k
            else:  # no loss scaling: skipped at a static scale of 1
                assert after["scale"] == before["scale"] == 1.0, k
        else:
            assert not _same(before["params"], after["params"]), k
            assert after["lr"] == pytest.approx(before["lr"] * 0.9), k
    assert (plugin.loss_scaler.skipped, plugin.loss_scaler.overflows) == (len(SKIP), len(SKIP))
    assert all(torch.isfinite(p).all() for p in model.parameters())
    if ON_CUDA:
        assert rows[-1]["params"][0].device.type == "cuda"


class _Capture(pl.Callback):
    """Per applied step: the optimizer's parameters (the masters) before the step, their gradients, and the
    parameters after it."""

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


@pytest.mark.parametrize("recipe", ["bf16-master", "16-master", "fp8-mixed"])
def test_the_masters_step_is_the_users_adamw_on_fp32_params(recipe):
    """The user's AdamW steps the FP32 masters on the training device as torch wrote it (torch's default
    implementation there): fed the gradients the masters received, an FP32 copy stepped by the same AdamW ends
    where the masters do, bit for bit.  CPU counterpart: tests/lightning/test_masters.py."""
    capture = _Capture()
    plugin = MixedPrecision(recipe, device=DEVICE, scaler={"init_scale": 2.0**8} if recipe.startswith("16") else None)
    model = Net()
    fit(plugin, model, steps=6, callbacks=[capture])
    assert plugin.loss_scaler.skipped == 0 and len(capture.after) == 6
    assert all(p.dtype == torch.float32 and p.device.type == DEVICE for p in capture.before[0])
    ref = [torch.nn.Parameter(p.clone()) for p in capture.before[0]]
    opt = torch.optim.AdamW(ref, lr=model.lr)
    for t, (grads, after) in enumerate(zip(capture.grads, capture.after, strict=True)):
        for p, g in zip(ref, grads, strict=True):
            p.grad = g.clone()
        opt.step()
        for i, (a, b) in enumerate(zip(after, ref, strict=True)):
            assert torch.equal(a, b.detach()), (t, i)
    masters = plugin.master_state_dict()
    for name, p in model.named_parameters():  # the weights are the rounded masters
        if name in masters:
            assert p.dtype != torch.float32 and torch.equal(p, masters[name].to(p.dtype)), name
