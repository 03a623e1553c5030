"""Small models and helpers for the Lightning adapter tests (importable by ddp_spawn children)."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def regression_data(n: int = 64, dim: int = 8, seed: int = 0) -> TensorDataset:
    """A fixed regression data set: y = x @ w + noise."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=g)
    w = torch.randn(dim, 1, generator=g)
    y = x @ w + 0.1 * torch.randn(n, 1, generator=g)
    return TensorDataset(x, y)


def loader(n: int = 64, batch_size: int = 8, dim: int = 8, seed: int = 0) -> DataLoader:
    """An unshuffled loader over :func:`regression_data` (8 steps per epoch by default)."""
    return DataLoader(regression_data(n, dim, seed), batch_size=batch_size, shuffle=False)


def ddp_fork() -> str:
    """``strategy=`` for 2 CPU ranks forked from this process: no re-import (a spawned rank imports ~15 s).

    Forking is safe here when this process holds no process group (the children would inherit it, and Lightning
    would not make theirs) and runs one intra-op thread (a child of a multi-threaded OpenMP process can hang in
    its next parallel region).  Where an earlier test left a process group or initialized CUDA (a GPU machine
    that ran tests/cuda first): ``ddp_spawn``, the slow way.
    """
    import torch.distributed as dist

    if (dist.is_available() and dist.is_initialized()) or torch.cuda.is_initialized():
        return "ddp_spawn"
    torch.set_num_threads(1)
    return "ddp_fork"


def trainer_kwargs(**overrides: Any) -> dict[str, Any]:
    """Quiet, CPU-only Trainer settings."""
    kw: dict[str, Any] = dict(
        accelerator="cpu", devices=1, enable_progress_bar=False, logger=False, enable_checkpointing=False,
        enable_model_summary=False, num_sanity_val_steps=0, deterministic=False,
    )
    kw.update(overrides)
    return kw


class TinyRegressor(pl.LightningModule):
    """Linear-ReLU-Linear regression; ``inf_steps`` multiplies the loss by inf at those global steps.

    Records per step: the loss scale (when the trainer has a scaler), the LR, and
    whether the step changed the parameters.
    """

    def __init__(self, inf_steps=(), lr: float = 1e-2, optimizer: str = "adam", scheduler: bool = False,
                 dim: int = 8, hidden: int = 16, seed: int = 0, norm: bool = False, fused: bool = False,
                 grad_inf_steps=(), grad_inf_rank: int | None = None, return_none_steps=()) -> None:
        super().__init__()
        torch.manual_seed(seed)
        layers: list[nn.Module] = [nn.Linear(dim, hidden)]
        if norm:
            layers.append(nn.LayerNorm(hidden))
        layers += [nn.ReLU(), nn.Linear(hidden, 1)]
        self.net = nn.Sequential(*layers)
        self.inf_steps = set(inf_steps)
        self.grad_inf_steps = set(grad_inf_steps)
        self.grad_inf_rank = grad_inf_rank
        self.return_none_steps = set(return_none_steps)
        self.lr = lr
        self.optimizer_name = optimizer
        self.use_scheduler = scheduler
        self.fused = fused
        self.scales: list[float] = []
        self.lrs: list[float] = []
        self.losses: list[float] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self(x).float(), y)
        self.losses.append(float(loss.detach()))
        if self.trainer.global_step in self.return_none_steps:
            return None
        if self.trainer.global_step in self.inf_steps:
            loss = loss * float("inf")
        return loss

    def on_after_backward(self) -> None:
        if self.trainer.global_step in self.grad_inf_steps and (
            self.grad_inf_rank is None or self.global_rank == self.grad_inf_rank
        ):
            p = next(iter(self.net.parameters()))
            p.grad.view(-1)[0] = float("inf")

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        scaler = self.trainer.scaler
        if scaler is not None:
            self.scales.append(float(scaler.get_scale()))
        self.lrs.append(self.trainer.optimizers[0].param_groups[0]["lr"])

    def configure_optimizers(self):
        extra = {"fused": True} if self.fused else {}
        if self.optimizer_name == "adam":
            opt = torch.optim.Adam(self.parameters(), lr=self.lr, **extra)
        elif self.optimizer_name == "adamw":
            opt = torch.optim.AdamW(self.parameters(), lr=self.lr)
        elif self.optimizer_name == "sgd":
            opt = torch.optim.SGD(self.parameters(), lr=self.lr)
        elif self.optimizer_name == "lbfgs":
            opt = torch.optim.LBFGS(self.parameters(), lr=self.lr)
        else:
            raise ValueError(self.optimizer_name)
        if not self.use_scheduler:
            return opt
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def params_of(module: nn.Module) -> dict[str, torch.Tensor]:
    """Detached copies of every parameter."""
    return {k: v.detach().clone() for k, v in module.named_parameters()}


class SaveRankState(pl.Callback):
    """At the end of fit, each rank saves its parameters, scaler counters and Adam steps to ``out_dir``."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir

    def on_train_end(self, trainer, pl_module) -> None:
        scaler = trainer.scaler
        opt = trainer.optimizers[0]
        torch.save(
            {
                "params": params_of(pl_module),
                "masters": {k: v.clone() for k, v in trainer.precision_plugin.master_state_dict().items()},
                "skipped": scaler.skipped,
                "overflows": scaler.overflows,
                "scale": scaler.get_scale(),
                "adam_steps": sorted({int(s["step"]) for s in opt.state.values()}),
                "lrs": list(pl_module.lrs),
            },
            f"{self.out_dir}/rank{trainer.global_rank}.pt",
        )
