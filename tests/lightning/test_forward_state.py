"""A skipped step writes nothing, BatchNorm's running statistics included (lightning_ext.loss_scale.ForwardState).

The forward pass updates BatchNorm's running mean, variance and batch counter before the step
is known to be skipped.  With one inf batch, under the Trainer plugin and under Fabric: the run
equals, bit for bit, a run that never saw that batch (weights, running statistics, counters),
its evaluation output is finite, and without the restore (``restore_forward_state=False``) the
statistics are NaN: what the restore prevents.  Also on a Hugging Face ResNet built from its
config (BatchNorm2d throughout), when transformers is installed.
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from torch import nn
from torch.utils.data import DataLoader

from lightning_ext import FabricMixedPrecision, MixedPrecision
from tests.lightning.helpers.models import trainer_kwargs

RECIPES = ("32-true", "bf16-mixed", "bf16-master", "16-mixed")
BAD = 2


def batches(n: int = 6, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 3, 6, 6, generator=g), torch.randint(0, 4, (8,), generator=g)) for _ in range(n)]


def bn_net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 16, 16),
                         nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))


def with_inf(data, step: int):
    x, y = data[step]
    x = x.clone()
    x[0, 0, 0, 0] = float("inf")
    return [*data[:step], (x, y), *data[step + 1:]]


class Module(pl.LightningModule):
    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x).float(), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def trainer_run(recipe: str, data, restore: bool = True) -> tuple[nn.Module, MixedPrecision]:
    module = Module(bn_net())
    plugin = MixedPrecision(recipe, restore_forward_state=restore)
    trainer = pl.Trainer(plugins=[plugin], max_steps=len(data), **trainer_kwargs())
    trainer.fit(module, DataLoader(data, batch_size=None))
    return module.net, plugin


def fabric_run(recipe: str, data, net: nn.Module | None = None) -> tuple[nn.Module, FabricMixedPrecision]:
    plugin = FabricMixedPrecision(recipe)
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    net = bn_net() if net is None else net
    model, opt = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9))
    for x, y in data:
        fabric.backward(F.cross_entropy(model(x).float(), y))
        opt.step()
        opt.zero_grad()
    return net, plugin


def stats(net: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("recipe", RECIPES)
def test_trainer_skip_equals_a_run_without_the_batch(recipe):
    data = batches()
    net, plugin = trainer_run(recipe, with_inf(data, BAD))
    assert plugin.loss_scaler.skipped == 1
    ref, _ = trainer_run(recipe, data[:BAD] + data[BAD + 1:])
    assert_same(stats(net), stats(ref))
    net.eval()
    assert torch.isfinite(net(data[0][0].to(next(net.parameters()).dtype)).float()).all()


def test_without_the_restore_the_statistics_are_poisoned():
    net, plugin = trainer_run("bf16-master", with_inf(batches(), BAD), restore=False)
    assert plugin.loss_scaler.skipped == 1
    assert not torch.isfinite(net[1].running_var).all()


@pytest.mark.parametrize("recipe", ["bf16-master", "16-mixed"])
def test_fabric_skip_equals_a_run_without_the_batch(recipe):
    data = batches()
    net, plugin = fabric_run(recipe, with_inf(data, BAD))
    assert plugin.loss_scaler.skipped == 1
    ref, _ = fabric_run(recipe, data[:BAD] + data[BAD + 1:])
    assert_same(stats(net), stats(ref))


def test_hugging_face_resnet_stays_finite_after_an_inf_batch():
    transformers = pytest.importorskip("transformers")
    config = transformers.ResNetConfig(num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1],
                                       layer_type="basic", num_labels=4)

    class HFNet(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.model = transformers.ResNetForImageClassification(config)

        def forward(self, x):
            return self.model(pixel_values=x).logits

    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(4, 3, 32, 32, generator=g), torch.randint(0, 4, (4,), generator=g)) for _ in range(4)]
    net, plugin = fabric_run("bf16-master", with_inf(data, 1), net=HFNet())
    ref, _ = fabric_run("bf16-master", data[:1] + data[2:], net=HFNet())
    assert plugin.loss_scaler.skipped == 1
    assert_same(stats(net), stats(ref))
    net.eval()
    with torch.no_grad(), plugin.forward_context():  # what the Fabric-wrapped module runs under
        assert torch.isfinite(net(plugin.convert_input(data[0][0])).float()).all()
    assert sum(isinstance(m, nn.BatchNorm2d) for m in net.modules()) >= 4


class _Counter(nn.Module):
    """Counts its training forwards in a buffer registered late (after the first step)."""

    def forward(self, x):
        if self.training and hasattr(self, "seen"):
            self.seen += 1
        return x


@pytest.mark.parametrize("how", ["register_buffer", "new submodule"])
def test_a_buffer_registered_after_the_first_step_is_kept(how):
    # The buffer owners are found once and kept until a module or buffer is registered anywhere:
    # a buffer that appears after the first step (or arrives inside a new submodule) is restored too.
    from lightning_ext.loss_scale import ForwardState

    root = nn.Sequential(nn.Linear(2, 2), _Counter())
    state = ForwardState()
    state.begin(root)
    state.end(False)
    if how == "register_buffer":
        root[1].register_buffer("seen", torch.zeros(()))
        counter = root[1]
    else:
        counter = _Counter()
        counter.register_buffer("seen", torch.zeros(()))
        root.append(counter)
    state.begin(root)
    root(torch.ones(1, 2))
    assert counter.seen.item() == 1
    state.end(True)  # skipped: the forward's write goes back
    assert counter.seen.item() == 0
    state.begin(root)
    root(torch.ones(1, 2))
    state.end(False)
    assert counter.seen.item() == 1
