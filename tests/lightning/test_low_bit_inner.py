"""torchao's low-bit optimizers (AdamW8bit, AdamW4bit, AdamWFp8) as the inner optimizer of bf16-sr and bf16-kahan:
the rounded weights are the core's rule applied to the same torchao optimizer run on FP32 copies, bit for bit; the
large weights' states stay quantized; the memory report counts them as stored and equals the core's estimate."""

from __future__ import annotations

import warnings

import lightning.pytorch as pl
import numpy as np
import pytest
import torch

from lightning_ext import MixedPrecision
from lightning_ext.diagnostics import held_tensors, memory_report
from mp_callbacks.memory import LOW_BIT_STATES, estimate_memory
from mp_callbacks.recipes import get_recipe
from mp_callbacks.weights import NUMPY_ROUNDING_OPS as N
from mp_callbacks.weights import kahan_apply, sr_key, stochastic_round
from tests.lightning.helpers.models import TinyRegressor, loader, trainer_kwargs

torchao_optim = pytest.importorskip("torchao.optim")


def bits(t: torch.Tensor) -> np.ndarray:
    return t.detach().contiguous().view(torch.int16).numpy().view(np.uint16)


class Net(TinyRegressor):
    def __init__(self, name: str, **kwargs):
        super().__init__(dim=64, hidden=64, **kwargs)  # a 64x64 weight: 4096 elements, quantized states
        self.name = name

    def configure_optimizers(self):
        return getattr(torchao_optim, self.name)(self.parameters(), lr=1e-2)


class Replay(pl.Callback):
    """Every step again with the same torchao optimizer on FP32 copies and the core's NumPy rules."""

    def __init__(self, plugin: MixedPrecision, name: str) -> None:
        self.plugin, self.name, self.checked = plugin, name, 0

    def on_train_start(self, trainer, pl_module):
        self.opt = trainer.optimizers[0]
        self.params = [p for g in self.opt.param_groups for p in g["params"]]
        self.shadow = [torch.zeros(p.shape) for p in self.params]
        self.ref = getattr(torchao_optim, self.name)(self.shadow, lr=1e-2)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        comps = {id(e.param): e.comp.clone() for e in self.plugin.rounding.entries() if e.comp is not None}
        self.before = [(p.detach().clone(), p.grad.clone(), comps.get(id(p))) for p in self.params]
        self.counter = self.plugin.rounding.stream.counter

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        with torch.no_grad():
            for s, (w, g, c) in zip(self.shadow, self.before):
                s.copy_(w.float() + c.float() if c is not None else w.float())
                s.grad = g.float()
        self.ref.step()
        comps = {id(e.param): e.comp for e in self.plugin.rounding.entries() if e.comp is not None}
        for i, (p, s, (w, _, c)) in enumerate(zip(self.params, self.shadow, self.before)):
            if c is not None:
                want_w, want_c = kahan_apply(bits(w), bits(c), s.numpy(), N)
                assert np.array_equal(bits(comps[id(p)]), want_c), i
            else:
                want_w = stochastic_round(s.numpy(), sr_key(self.plugin.rounding.stream.seed, i, self.counter), N)
            assert np.array_equal(bits(p), want_w), i
            got, want = self.opt.state[p], self.ref.state[s]
            assert list(got) == list(want) and all(type(got[k]) is type(v) for k, v in want.items())
            for k, v in want.items():
                assert all(torch.equal(a, b) for a, b in zip(held_tensors(got[k]), held_tensors(v), strict=True))
        self.checked += 1


@pytest.mark.parametrize(("recipe", "name"), [("bf16-sr", "AdamW8bit"), ("bf16-sr", "AdamW4bit"),
                                              ("bf16-sr", "AdamWFp8"), ("bf16-kahan", "AdamW8bit")])
def test_a_low_bit_inner_optimizer_is_itself_on_fp32_copies_and_counted_as_stored(recipe, name):
    warnings.filterwarnings("ignore")
    plugin = MixedPrecision(recipe, seed=7)
    replay = Replay(plugin, name)
    model = Net(name)
    trainer = pl.Trainer(plugins=[plugin], callbacks=[replay], max_steps=3, **trainer_kwargs())
    trainer.fit(model, loader(dim=64))
    assert replay.checked == 3
    opt = trainer.optimizers[0]
    big = model.net[0].weight
    assert big.dtype == torch.bfloat16 and all(type(opt.state[big][k]) is not torch.Tensor
                                               for k in ("exp_avg", "exp_avg_sq"))  # quantized
    report = memory_report(plugin, model, [opt])
    assert report["optimizers"] == [name.lower()]
    assert report["actual"]["optimizer_state"] == report["estimate"]["optimizer_state"]


@pytest.mark.parametrize("name", ["AdamW8bit", "AdamW4bit", "AdamWFp8"])
@pytest.mark.parametrize("numel", [4096, 4096 * 3, 1 << 20, 4000, 64])
def test_the_core_layout_is_the_bytes_torchao_allocates(name, numel):
    """The core's LOW_BIT_STATES against torchao's own buffers: m and v of a parameter, as allocated."""
    p = torch.zeros(numel)
    opt = getattr(torchao_optim, name)([p], lr=1e-3)
    held = sum(h.nbytes for signed in (True, False) for h in held_tensors(opt._new_buffer(p, signed)))
    assert held == LOW_BIT_STATES[name.lower()].slot_bytes(numel, 4) * 2
    est = estimate_memory(get_recipe("bf16-sr").master, name, [(numel, "bfloat16")])
    assert est.optimizer_state == held and est.weights == est.grads == 2 * numel
