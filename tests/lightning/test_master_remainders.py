"""``master_remainders``: FP32 masters held as bf16 weight + int16 remainder give the masters of the FP32-copy
``bf16-master`` bit for bit (same gradients, overflows and skips included), export FP32 masters, and hold
2 B/param less."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from torch import nn

from lightning_ext import FabricMonitor
from lightning_ext.diagnostics import memory_report
from lightning_ext.fabric import MixedPrecision
from mp_callbacks.memory import bytes_per_param
from mp_callbacks.recipes import get_recipe
from mp_callbacks.weights import bf16_bits, split_master
from tests.lightning.helpers.models import loader

OPTIMIZERS = {
    "adamw-fused": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1),
    "adam-foreach": lambda p: torch.optim.Adam(p, lr=1e-2, foreach=True),
    "sgd-momentum": lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9),
    "adagrad": lambda p: torch.optim.Adagrad(p, lr=1e-2),
    "rmsprop": lambda p: torch.optim.RMSprop(p, lr=1e-3),
}


def net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.LayerNorm(32), nn.ReLU(), nn.Linear(32, 1))


def setup(remainders: bool, make_opt=OPTIMIZERS["adamw-fused"], scaler=None, callbacks=()):
    plugin = MixedPrecision("bf16-master", scaler=scaler, master_remainders=remainders)
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin], callbacks=list(callbacks))
    model = net()
    model, opt = fabric.setup(model, make_opt(model.parameters()))
    return fabric, model, opt, plugin


def bits(t: torch.Tensor) -> np.ndarray:
    return t.detach().float().contiguous().view(torch.int32).numpy().copy()


def raw_state(opt) -> dict[str, torch.Tensor]:
    raw = opt.optimizer if hasattr(opt, "optimizer") else opt
    return {f"{i}.{k}": v.clone() for i, p in enumerate(p for g in raw.param_groups for p in g["params"])
            for k, v in raw.state.get(p, {}).items() if torch.is_tensor(v)}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_same_gradients_give_the_fp32_copy_masters_bit_for_bit(name):
    """The same bf16 gradients (inf on some steps: skipped, the scale backs off) into both plugins."""
    runs = [setup(r, OPTIMIZERS[name], scaler={"init_scale": 2.0**10, "growth_interval": 3}) for r in (False, True)]
    gen = torch.Generator().manual_seed(1)
    for step in range(12):
        grads = [torch.randn(p.shape, generator=gen) * 100 for p in runs[0][1].parameters()]
        if step in (2, 3, 7):
            grads[step % len(grads)].view(-1)[0] = float("inf")
        for _, model, opt, _ in runs:
            for p, g in zip(model.parameters(), grads):
                p.grad = g.to(p.dtype, copy=True)
            opt.step()
            opt.zero_grad()
        (_, _, o0, copy), (_, _, o1, rem) = runs
        masters0, masters1 = copy.master_state_dict(), rem.master_state_dict()
        assert masters0.keys() == masters1.keys()
        for key in masters0:
            np.testing.assert_array_equal(bits(masters0[key]), bits(masters1[key]), err_msg=f"{key} step {step}")
        s0, s1 = raw_state(o0), raw_state(o1)
        assert s0.keys() == s1.keys() and all(torch.equal(s0[k], s1[k]) for k in s0)
        assert copy.loss_scaler.state_dict() == rem.loss_scaler.state_dict()
        for e0, e1 in zip(copy.masters.entries(), rem.masters.entries()):  # FP32 copy: nearest even
            x = masters0[e0.name].numpy()                                      # remainders: the core's split
            np.testing.assert_array_equal(e0.low.detach().view(torch.int16).numpy().view(np.uint16), bf16_bits(x))
            np.testing.assert_array_equal(e1.low.detach().view(torch.int16).numpy().view(np.uint16), split_master(x)[0])
    assert copy.loss_scaler.skipped == rem.loss_scaler.skipped == 3


def train(fabric, model, opt, steps: int) -> list[float]:
    batches, losses = list(loader()), []
    for step in range(steps):
        x, y = batches[step % len(batches)]
        loss = F.mse_loss(model(x), y)
        losses.append(float(loss.detach()))
        fabric.backward(loss)
        opt.step()
        opt.zero_grad()
    return losses


def test_training_tracks_the_fp32_copy_and_the_monitor_reads_fp32_masters():
    """Own gradients: the forward weights differ only on ties, so the run follows the FP32-copy run; the
    swamping meter reads the joined FP32 masters on the same steps."""
    losses, swamped = {}, {}
    for remainders in (False, True):
        monitor = FabricMonitor(log_every_n_steps=5)
        losses[remainders] = train(*setup(remainders, callbacks=[monitor])[:3], 30)
        swamped[remainders] = monitor.history.series("mp/update_swamped_frac")
    np.testing.assert_allclose(losses[True], losses[False], rtol=2e-2)
    assert len(swamped[True]) == len(swamped[False]) > 0 and None not in swamped[True]


def test_checkpoint_exports_fp32_masters_and_resume_is_exact(tmp_path):
    fabric, model, opt, plugin = setup(True)
    train(fabric, model, opt, 5)
    fabric.save(tmp_path / "c.ckpt", {"model": model, "optimizer": opt, "mp": plugin})
    masters = plugin.master_state_dict()
    assert all(v.dtype == torch.float32 for v in masters.values())
    saved = torch.load(tmp_path / "c.ckpt", weights_only=True)
    record = saved["mp"]["masters"]
    assert record.keys() == masters.keys() and all(torch.equal(record[k], masters[k]) for k in masters)
    reference = train(fabric, model, opt, 5)
    fabric2, model2, opt2, plugin2 = setup(True)
    plugin2.setup_optimizers(opt2)  # the masters in the optimizer before its state loads
    fabric2.load(tmp_path / "c.ckpt", {"model": model2, "optimizer": opt2, "mp": plugin2})
    assert train(fabric2, model2, opt2, 5) == reference


def test_fourteen_bytes_per_param_estimated_and_held():
    plan = get_recipe("bf16-master", master_remainders=True).master
    assert bytes_per_param(plan, "adamw") == 14.0 == bytes_per_param(get_recipe("bf16-master").master, "adamw") - 2
    held = {}
    for remainders in (False, True):
        fabric, model, opt, plugin = setup(remainders)
        train(fabric, model, opt, 2)
        x, y = next(iter(loader()))
        fabric.backward(F.mse_loss(model(x), y))  # after the backward: bf16 grads, weights, masters, states
        report = memory_report(plugin, model, [opt])
        low = sum(p.numel() for p in model.parameters() if p.dtype == torch.bfloat16)
        held[remainders] = report["actual"]["masters"] / low
        storages = {id(p.untyped_storage()): p.untyped_storage().nbytes() for p in model.parameters()}
        assert all(n > 0 for n in storages.values())
    assert held == {False: 4.0, True: 2.0}


def test_trainer_checkpoint_weights_are_the_fp32_masters(tmp_path):
    """The Trainer plugin: a saved checkpoint's model weights are the joined FP32 masters (an FP32 model loads
    them exactly), and overflow steps are skipped as under the FP32 copy."""
    import lightning.pytorch as pl

    from lightning_ext import MixedPrecision as TrainerMixedPrecision
    from tests.lightning.helpers.models import TinyRegressor, trainer_kwargs

    plugin = TrainerMixedPrecision("bf16-master", master_remainders=True, scaler={"init_scale": 2.0**8})
    trainer = pl.Trainer(max_steps=6, plugins=[plugin], **trainer_kwargs())
    model = TinyRegressor(inf_steps={2})
    trainer.fit(model, loader())
    trainer.save_checkpoint(tmp_path / "t.ckpt")
    weights = torch.load(tmp_path / "t.ckpt", weights_only=True)["state_dict"]
    masters = plugin.master_state_dict()
    assert masters and all(weights[k].dtype == torch.float32 and torch.equal(weights[k], v) for k, v in masters.items())
    assert plugin.loss_scaler.skipped == 1
