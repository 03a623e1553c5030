"""Lightning variants: one recipe, ours or native, through the Trainer or Fabric, as a harness variant.

A :class:`harness.Variant` names what runs: the side (``ours``: ``lightning_ext.MixedPrecision`` /
``lightning_ext.FabricMixedPrecision``; ``native``: Lightning's own plugin, built as ``Trainer(precision=...)`` /
``Fabric(precision=...)`` builds it: ``Precision()`` for ``32-true``, ``MixedPrecision("16-mixed", device,
GradScaler(device))``, ``MixedPrecision("bf16-mixed", device)``), the recipe and the user's AdamW (torch's default
implementation, ``foreach=True`` or ``fused=True``), which both sides run untouched.  Native has the three recipes
Lightning has; every other recipe is compared with :func:`harness.native_of`'s.

:func:`trainer_build` and :func:`fabric_build` return a :data:`harness.Build`: the model, optimizer and loop are
made when it is called, the returned ``train()`` trains ``clock.total`` steps, with ``clock.begin()`` /
``clock.end()`` around each (the Trainer: a callback's ``on_train_batch_start`` / ``on_train_batch_end``; Fabric:
around forward, backward, ``optimizer.step()`` and ``zero_grad``).  Any object with ``begin``, ``end`` and
``total`` works as the clock (``launches.py`` counts ops with one).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from harness import Variant
from torch import nn
from torch.utils.data import DataLoader

from lightning_ext import FabricMixedPrecision, MixedPrecision


def adamw(params: Any, optimizer: str = "default", lr: float = 1e-3) -> torch.optim.AdamW:
    """The user's AdamW: torch's default implementation, or ``foreach=True`` / ``fused=True``."""
    return torch.optim.AdamW(params, lr=lr, foreach=True if optimizer == "foreach" else None,
                             fused=True if optimizer == "fused" else None)


def trainer_plugin(v: Variant, device: str = "cpu", options: dict | None = None) -> Any:
    """The Trainer's precision plugin of ``v``; ``options``: more arguments of ours (``fp8=``, ``state_dtype=``...)."""
    if v.side == "ours":
        return MixedPrecision(v.recipe, device, **(options or {}))
    from lightning.pytorch.plugins.precision import MixedPrecision as Native
    from lightning.pytorch.plugins.precision import Precision

    if v.recipe == "32-true":
        return Precision()
    return Native(v.recipe, device, torch.amp.GradScaler(device) if v.recipe == "16-mixed" else None)


def fabric_plugin(v: Variant, device: str = "cpu", options: dict | None = None) -> Any:
    """Fabric's precision plugin of ``v``; ``options`` as :func:`trainer_plugin`'s."""
    if v.side == "ours":
        return FabricMixedPrecision(v.recipe, device, **(options or {}))
    from lightning.fabric.plugins.precision import MixedPrecision as Native
    from lightning.fabric.plugins.precision import Precision

    if v.recipe == "32-true":
        return Precision()
    return Native(v.recipe, device, torch.amp.GradScaler(device) if v.recipe == "16-mixed" else None)


class LM(pl.LightningModule):
    """``net`` trained on (inputs, targets) batches with ``loss(net(x), y)`` and the user's AdamW."""

    def __init__(self, net: nn.Module, loss: Callable[..., torch.Tensor], optimizer: str = "default") -> None:
        super().__init__()
        self.net, self.loss, self.optimizer_kind = net, loss, optimizer

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return self.loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return adamw(self.parameters(), self.optimizer_kind)


class StepHooks(pl.Callback):
    """``clock.begin()`` at ``on_train_batch_start``, ``clock.end()`` at ``on_train_batch_end``: the step between
    them is the training step, the backward and the optimizer step (automatic optimization)."""

    def __init__(self, clock: Any) -> None:
        self.clock = clock

    def on_train_batch_start(self, *args: Any) -> None:
        self.clock.begin()

    def on_train_batch_end(self, *args: Any) -> None:
        self.clock.end()


def _cycled(batches: list, n: int) -> list:
    return [batches[i % len(batches)] for i in range(n)]


def trainer_build(v: Variant, make_net: Callable[[], nn.Module], batches: list, loss: Callable[..., torch.Tensor],
                  device: str = "cpu", options: dict | None = None, callbacks: tuple = (),
                  ) -> Callable[[Any], Callable[[], Any]]:
    """A harness variant: ``Trainer(plugins=[plugin])`` fitting ``make_net()`` on ``batches`` (cycled)."""
    def build(clock: Any) -> Callable[[], Any]:
        module = LM(make_net(), loss, v.optimizer)
        trainer = pl.Trainer(accelerator=device, devices=1, plugins=[trainer_plugin(v, device, options)],
                             max_steps=clock.total, max_epochs=-1, callbacks=[StepHooks(clock), *callbacks],
                             logger=False, enable_checkpointing=False, enable_progress_bar=False,
                             enable_model_summary=False, num_sanity_val_steps=0)
        loader = DataLoader(_cycled(batches, clock.total), batch_size=None)
        return lambda: trainer.fit(module, train_dataloaders=loader)
    return build


def fabric_build(v: Variant, make_net: Callable[[], nn.Module], batches: list, loss: Callable[..., torch.Tensor],
                 device: str = "cpu", options: dict | None = None) -> Callable[[Any], Callable[[], Any]]:
    """A harness variant: ``Fabric(plugins=[plugin])``, ``fabric.setup(net, AdamW)``, the user's loop."""
    def build(clock: Any) -> Callable[[], Any]:
        from lightning.fabric import Fabric

        fabric = Fabric(accelerator=device, devices=1, plugins=[fabric_plugin(v, device, options)])
        net = make_net()
        model, opt = fabric.setup(net, adamw(net.parameters(), v.optimizer))
        data = [fabric.to_device(b) for b in batches]

        def train() -> None:
            for i in range(clock.total):
                x, y = data[i % len(data)]
                clock.begin()
                fabric.backward(loss(model(x), y))
                opt.step()
                opt.zero_grad(set_to_none=True)
                clock.end()
        return train
    return build


BUILDERS = {"trainer": trainer_build, "fabric": fabric_build}
