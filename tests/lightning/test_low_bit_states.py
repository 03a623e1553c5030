"""state_dtype="8bit" in Lightning: the user's AdamW becomes torchao's AdamW8bit (whose map, blocks and codes are
the core's rule, tests/core/test_quantized_states.py); a run under the knob is bit for bit the run with torchao's
AdamW8bit given directly; the memory report equals the estimate; other optimizers are a clear error."""

from __future__ import annotations

import warnings

import lightning.pytorch as pl
import pytest
import torch

from lightning_ext import MixedPrecision
from lightning_ext.memory import memory_report
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
    assert type(opt) is torchao_optim.AdamW8bit
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
