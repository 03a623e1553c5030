"""Small models for the MixedPrecisionMonitor tests."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from mp_callbacks.policy import PrecisionPolicy


class Amplify(nn.Module):
    """``x * 1e6 * 1e-6``: identity in FP32, inf in fp16 (the product passes 65504).

    ``only_rank``: amplify on that process rank only (``rank`` is set by the model at fit start).
    """

    def __init__(self, only_rank: int | None = None) -> None:
        super().__init__()
        self.only_rank = only_rank
        self.rank = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.only_rank is not None and self.rank != self.only_rank:
            return x
        return x * 1e6 * 1e-6


AMPLIFY_FP16 = PrecisionPolicy(params="float32", compute="float16", output="float32",
                               module_rules=(("Amplify", "float16"),))
"""The 16-mixed policy with :class:`Amplify` declared low precision (custom modules default to FP32)."""


class AmplifiedRegressor(pl.LightningModule):
    """Linear -> Amplify -> ReLU -> Linear: overflows under fp16 compute until ``net.1`` runs in FP32."""

    def __init__(self, inf_steps=(), lr: float = 1e-2, only_rank: int | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), Amplify(only_rank), nn.ReLU(), nn.Linear(16, 1))
        self.inf_steps = set(inf_steps)
        self.lr = lr

    def on_fit_start(self) -> None:
        self.net[1].rank = self.global_rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self(x).float(), y)
        if self.trainer.global_step in self.inf_steps:
            loss = loss * float("inf")
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class OnesLinear(pl.LightningModule):
    """``mean(x @ w)`` with ``w`` = 1 and ``x`` = 1: every gradient is exactly 1, so SGD's update is ``-lr``."""

    def __init__(self, lr: float = 1e-5, dim: int = 64) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, 1, bias=False)
        with torch.no_grad():
            self.lin.weight.fill_(1.0)
        self.lr = lr

    def training_step(self, batch, batch_idx):
        x, _ = batch
        return self.lin(x).float().sum() / x.shape[0]

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def ones_loader(dim: int = 64, n: int = 16, batch_size: int = 4) -> DataLoader:
    """Inputs of ones (gradient of :class:`OnesLinear` exactly 1 per weight)."""
    return DataLoader(TensorDataset(torch.ones(n, dim), torch.zeros(n, 1)), batch_size=batch_size)


class Fp32Head(nn.Module):
    """A custom (policy-unknown, so FP32) linear map: its gradients never pass through fp16."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(1, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.t()


class SpreadGrads(pl.LightningModule):
    """``sum(head(x)) * 1e-4`` with ``x_j = 10**(-j/2)``: FP32 gradients spread over eight decades."""

    def __init__(self, inf_steps=(), dim: int = 17) -> None:
        super().__init__()
        self.head = Fp32Head(dim)
        self.inf_steps = set(inf_steps)

    def training_step(self, batch, batch_idx):
        x, _ = batch
        loss = self.head(x).sum() * 1e-4
        if self.trainer.global_step in self.inf_steps:
            loss = loss * float("inf")
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-3)


def spread_loader(dim: int = 17, n: int = 16) -> DataLoader:
    """One row per batch: ``x_j = 10**(-j/2)``."""
    x = (10.0 ** (-torch.arange(dim, dtype=torch.float32) / 2)).repeat(n, 1)
    return DataLoader(TensorDataset(x, torch.zeros(n, 1)), batch_size=1)


class SaveMonitorState(pl.Callback):
    """At the end of fit, each rank saves its monitor's history, the plugin policy's rules and its parameters."""

    def __init__(self, out_dir: str, monitor) -> None:
        self.out_dir = out_dir
        self.monitor = monitor

    def on_train_end(self, trainer, pl_module) -> None:
        torch.save(
            {
                "modules": [s.overflow_module for s in self.monitor.history if s.overflow],
                "events": [e["kind"] for e in self.monitor.history.events if e["kind"] != "memory"],
                "rules": [list(r) for r in trainer.precision_plugin.policy.module_rules],
                "overflows": trainer.scaler.overflows,
                "params": {k: v.detach().clone() for k, v in pl_module.named_parameters()},
            },
            f"{self.out_dir}/monitor_rank{trainer.global_rank}.pt",
        )
