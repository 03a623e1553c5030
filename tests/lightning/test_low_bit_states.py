"""state_dtype="8bit" in Lightning: torchao's AdamW8bit (whose map, blocks and codes are the core's rule,
tests/core/test_quantized_states.py) computes the user's AdamW's step, the user's optimizer object kept; a run
under the knob is bit for bit the run with torchao's AdamW8bit given directly; the memory report equals the
estimate; other optimizers are a clear error."""

from __future__ import annotations

import warnings

import lightning.pytorch as pl
import pytest
import torch

from lightning_ext import MixedPrecision
from lightning_ext.diagnostics import memory_report
from tests.lightning.helpers.models import TinyRegressor, loader, trainer_kwargs

torchao_optim = pytest.importorskip("torchao.optim")


class Net(TinyRegressor):
    def __init__(self, name: str, **kwargs):
        super().__init__(dim=64, hidden=64, **kwargs)  # a 64x64 weight: 4096 elements, quantized states
        self.name = name

    def configure_optimizers(self):
        if self.name == "AdamW8bit":
            return torchao_optim.AdamW8bit(self.parameters(), lr=1e-2, weight_decay=1e-2)
        return getattr(torch.optim, self.name)(self.parameters(), lr=1e-2, weight_decay=1e-2)


def fit(recipe: str, name: str, states: str | None):
    warnings.filterwarnings("ignore")
    plugin = MixedPrecision(recipe, seed=7, state_dtype=states)
    model = Net(name)
    trainer = pl.Trainer(plugins=[plugin], max_steps=4, **trainer_kwargs())
    trainer.fit(model, loader(dim=64))
    return plugin, model, trainer.optimizers[0]


@pytest.mark.parametrize("recipe", ["bf16-sr", "bf16-master"])
def test_the_knob_runs_torchaos_adamw8bit_bit_for_bit(recipe):
    plugin, model, opt = fit(recipe, "AdamW", "8bit")
    _, direct, _ = fit(recipe, "AdamW8bit", None)
    assert type(opt) is torch.optim.AdamW  # the user's object, its state torchao's
    for a, b in zip(model.parameters(), direct.parameters(), strict=True):
        assert a.dtype == b.dtype and torch.equal(a.view(torch.int16) if a.dtype == torch.bfloat16 else a,
                                                  b.view(torch.int16) if b.dtype == torch.bfloat16 else b)
    big = plugin.masters.master_of(model.net[0].weight) if plugin.masters else model.net[0].weight
    assert all(type(opt.state[big][k]).__name__ == "OptimState8bit" for k in ("exp_avg", "exp_avg_sq"))
    report = memory_report(plugin, model, [opt])
    assert report["actual"]["optimizer_state"] == report["estimate"]["optimizer_state"]


def test_other_optimizers_are_a_clear_error():
    with pytest.raises(ValueError, match="must be torch.optim.AdamW"):
        fit("bf16-sr", "SGD", "8bit")


# ------------------------------------------------------------------ resume
class Scheduled(Net):
    """AdamW with a per-step LR schedule (made before the plugin builds its AdamW8bit) and a skipped step."""

    def __init__(self):
        super().__init__("AdamW", inf_steps={2}, scheduler=True, optimizer="adamw")

    def configure_optimizers(self):
        return TinyRegressor.configure_optimizers(self)


def trainer_fit(recipe: str, epochs: int, ckpt_path=None):
    warnings.filterwarnings("ignore")
    model = Scheduled()
    trainer = pl.Trainer(plugins=[MixedPrecision(recipe, seed=7, state_dtype="8bit")], max_epochs=epochs,
                         **trainer_kwargs())
    trainer.fit(model, loader(n=32, dim=64), ckpt_path=ckpt_path)  # 4 steps an epoch
    return model, trainer


def quantized(opt) -> list[tuple[torch.Tensor, ...]]:
    out = []
    for state in opt.state.values():
        for k in ("exp_avg", "exp_avg_sq"):
            v = state[k]
            out.append((v.codes, v.scale) if type(v).__name__ == "OptimState8bit" else (v,))
    return out


def assert_same_run(model_a, opt_a, model_b, opt_b):
    for a, b in zip(model_a.parameters(), model_b.parameters(), strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)
    qa, qb = quantized(opt_a), quantized(opt_b)
    assert len(qa) == len(qb) and any(len(t) == 2 for t in qa)  # the 64x64 weight's m and v are quantized
    assert all(torch.equal(x, y) for ta, tb in zip(qa, qb, strict=True) for x, y in zip(ta, tb, strict=True))
    assert [float(s["step"]) for s in opt_a.state.values()] == [float(s["step"]) for s in opt_b.state.values()]
    assert float(opt_a.param_groups[0]["lr"]) == float(opt_b.param_groups[0]["lr"])


@pytest.mark.parametrize("recipe", ["bf16-sr", "bf16-master"])
def test_trainer_resume_from_a_checkpoint_is_bit_for_bit(tmp_path, recipe):
    """Saved after 2 of 4 epochs (a skipped step and LR-schedule steps before it), resumed by ``ckpt_path``:
    the uninterrupted run's weights, 8-bit codes and scales, steps and LR; the file is plain data."""
    full_model, full = trainer_fit(recipe, 4)
    _, first = trainer_fit(recipe, 2)
    path = tmp_path / "q.ckpt"
    first.save_checkpoint(path)
    saved = torch.load(path, weights_only=True)  # plain data: no tensor subclass in the file
    records = [v for s in saved["optimizer_states"][0]["state"].values() for v in s.values() if isinstance(v, dict)]
    assert {r["torchao_state"] for r in records} == {"OptimState8bit"}
    assert all(r["tensors"]["codes"].dtype == torch.uint8 for r in records)
    resumed_model, resumed = trainer_fit(recipe, 4, ckpt_path=path)
    assert type(resumed.optimizers[0]) is torch.optim.AdamW
    assert_same_run(full_model, full.optimizers[0], resumed_model, resumed.optimizers[0])


def fabric_run(recipe: str, steps: range, load=None, save=None):
    from lightning.fabric import Fabric

    from lightning_ext.fabric import MixedPrecision as FabricMixedPrecision

    warnings.filterwarnings("ignore")
    plugin = FabricMixedPrecision(recipe, seed=7, state_dtype="8bit")
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    torch.manual_seed(0)
    net = Net("AdamW").net
    model, opt = fabric.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=1e-2))
    state = {"model": model, "optimizer": opt, "mp": plugin}
    if load is not None:
        plugin.setup_optimizers(opt)  # the 8-bit states' optimizer before its state loads
        fabric.load(load, state)
    batches = list(loader(n=32, dim=64))
    for step in steps:
        x, y = batches[step % len(batches)]
        loss = torch.nn.functional.mse_loss(model(x).float(), y)
        fabric.backward(loss * float("inf") if step == 2 else loss)  # a skipped step before the save
        opt.step()
        opt.zero_grad()
    if save is not None:
        fabric.save(save, state)
    return model, opt.optimizer


@pytest.mark.parametrize("recipe", ["bf16-sr", "bf16-kahan"])
def test_fabric_save_load_resume_is_bit_for_bit(tmp_path, recipe):
    full_model, full_opt = fabric_run(recipe, range(8))
    fabric_run(recipe, range(4), save=tmp_path / "f.ckpt")
    torch.load(tmp_path / "f.ckpt", weights_only=True)  # plain data
    resumed_model, resumed_opt = fabric_run(recipe, range(4, 8), load=tmp_path / "f.ckpt")
    assert_same_run(full_model, full_opt, resumed_model, resumed_opt)
