"""What the CUDA tests share: where they run, a small model that exercises every recipe, Trainer settings.

Every test here is marked ``cuda`` and skipped unless ``torch.cuda.is_available()``.  For checking
the tests themselves on a machine without a GPU, ``MP_CUDA_TESTS_DEVICE=cpu`` runs their bodies on
the CPU (the assertions that need CUDA, such as "the fused kernel ran on a CUDA tensor" or
"``torch._scaled_mm`` ran", are then not made); nothing in ``make test`` sets it.

No keras/tensorflow import anywhere here: the GPU check runs ``pytest -m cuda`` on a machine that
may not have them.
"""

from __future__ import annotations

import os
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

DEVICE = "cpu" if os.environ.get("MP_CUDA_TESTS_DEVICE") == "cpu" else "cuda"
ON_CUDA = DEVICE == "cuda"
RUNNABLE = torch.cuda.is_available() or not ON_CUDA
SKIP_REASON = "needs a CUDA device: torch.cuda.is_available() is False"

cuda_only = [pytest.mark.cuda, pytest.mark.skipif(not RUNNABLE, reason=SKIP_REASON)]
"""``pytestmark`` of every module in tests/cuda."""


def fp8_tensor_cores() -> bool:
    """True where ``fp8-mixed`` takes ``torch._scaled_mm``: CUDA with compute capability >= 8.9."""
    return (ON_CUDA and torch.cuda.is_available() and hasattr(torch, "_scaled_mm")
            and torch.cuda.get_device_capability() >= (8, 9))


def loader(n: int = 64, batch_size: int = 8, dim: int = 32, out: int = 16, seed: int = 0) -> DataLoader:
    """A fixed regression data set (y = tanh(x @ w)), unshuffled: ``n / batch_size`` steps per epoch."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=g)
    y = torch.tanh(x @ torch.randn(dim, out, generator=g) / dim ** 0.5)
    return DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=False)


def trainer_kwargs(**overrides: Any) -> dict[str, Any]:
    """Quiet single-device Trainer settings on :data:`DEVICE`."""
    kw: dict[str, Any] = dict(accelerator=DEVICE, devices=1, enable_progress_bar=False, logger=False,
                              enable_checkpointing=False, enable_model_summary=False, num_sanity_val_steps=0)
    kw.update(overrides)
    return kw


class Net(pl.LightningModule):
    """Linear(32, 64) -> LayerNorm -> GELU -> Linear(64, 64) -> GELU -> Linear(64, 16), AdamW.

    Every matmul has both dimensions multiples of 16 (``torch._scaled_mm``'s condition under
    ``fp8-mixed``); the LayerNorm stays FP32 under every recipe.  ``inf_steps``: the loss is
    multiplied by inf at those global steps.  ``losses`` records every step's loss (device tensors,
    read after the fit).
    """

    def __init__(self, inf_steps=(), lr: float = 1e-2, seed: int = 0, scheduler: bool = False) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.net = nn.Sequential(nn.Linear(32, 64), nn.LayerNorm(64), nn.GELU(), nn.Linear(64, 64), nn.GELU(),
                                 nn.Linear(64, 16))
        self.inf_steps = set(inf_steps)
        self.lr = lr
        self.use_scheduler = scheduler
        self.losses: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.mse_loss(self(x).float(), y)
        self.losses.append(loss.detach())
        if self.trainer.global_step in self.inf_steps:
            loss = loss * float("inf")
        return loss

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=self.lr)
        if not self.use_scheduler:
            return opt
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def fit(plugin: Any, model: pl.LightningModule, steps: int, callbacks=(), **kwargs: Any) -> pl.Trainer:
    """``steps`` optimizer steps of ``model`` under ``plugin`` on :data:`DEVICE`."""
    trainer = pl.Trainer(plugins=[plugin], max_steps=steps, callbacks=list(callbacks), **trainer_kwargs(**kwargs))
    trainer.fit(model, loader())
    return trainer
