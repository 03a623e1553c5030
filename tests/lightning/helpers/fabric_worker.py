"""Two-process scenarios of tests/lightning/test_fabric_ddp.py: ``worker(out)``, run in the test run's one
torchrun launch (helpers/torchrun.py).

Each rank runs every scenario in turn (Fabric's DDPStrategy and ModelParallelStrategy take the processes
torchrun made; gloo on CPU) and saves plain data to ``OUT/<scenario>_rank<r>.pt``; the test file asserts.
Scenarios: DDP with an inf in rank 1's gradients only (``ddp_skip``), FSDP2 ``bf16-master`` with an inf
in rank 1's gradient shard only, monitored (``fsdp_skip``), and a DDP ``fabric.save``/``fabric.load``
resume (``ddp_resume``).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from lightning.fabric.strategies import DDPStrategy, ModelParallelStrategy
from torch import nn

from lightning_ext import CommCounter
from lightning_ext.diagnostics import FabricMonitor
from lightning_ext.distributed import fully_shard_model, local
from lightning_ext.fabric import MixedPrecision
from tests.lightning.helpers.models import regression_data

INF_STEP, STEPS, BATCH = 2, 5, 8


def rank() -> int:
    return int(os.environ["RANK"])


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.ReLU(), nn.Linear(16, 1))


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's half of the data, in order."""
    x, y = regression_data(2 * STEPS * BATCH, 8).tensors
    return [(x[i:i + BATCH], y[i:i + BATCH]) for i in range(rank() * BATCH, len(x), 2 * BATCH)]


def snapshot(module: nn.Module, optimizer, plugin) -> dict:
    """This rank's parameters (local shards), optimizer states, masters."""
    names = {id(p): n for n, p in module.named_parameters()}
    masters = plugin.master_state_dict()
    by_id = {id(e.master): e.name for e in plugin.masters.entries()} if plugin.masters is not None else {}
    return {"params": {n: local(p).detach().clone() for n, p in module.named_parameters()},
            "masters": {n: m.clone() for n, m in masters.items()},
            "states": {f"{names.get(id(p), by_id.get(id(p)))}.{k}": local(v).detach().clone()
                       for p, s in optimizer.state.items() for k, v in s.items() if torch.is_tensor(v)}}


def train(fabric: Fabric, net, opt, plugin) -> dict:
    """The Fabric loop; at INF_STEP rank 1's first gradient (its local shard) gets an inf after the reduction."""
    steps, losses = [], []
    for step, (x, y) in enumerate(batches()):
        x, y = fabric.to_device((x, y))
        loss = F.mse_loss(net(x), y)
        losses.append(float(loss.detach()))
        fabric.backward(loss)
        if step == INF_STEP and rank() == 1:
            local(next(iter(net.parameters())).grad).view(-1)[0] = float("inf")
        before = snapshot(net.module, opt.optimizer, plugin)
        opt.step()
        opt.zero_grad()
        steps.append({"before": before, "after": snapshot(net.module, opt.optimizer, plugin),
                      "skipped": plugin.last_step_skipped(opt)})
    return {"steps": steps, "losses": losses, "skipped": plugin.loss_scaler.skipped,
            "overflows": plugin.loss_scaler.overflows}


def ddp_skip(out: Path) -> dict:
    plugin = MixedPrecision("16-master", scaler={"init_scale": 2.0**8, "growth_interval": 1000})
    plugin.comm_counter = CommCounter()  # the DDP hook Fabric's set-up gets: fp16 buckets reduced in FP32
    fabric = Fabric(accelerator="cpu", devices=2, strategy=DDPStrategy(), plugins=[plugin])
    fabric.launch()
    net = model()
    net, opt = fabric.setup(net, torch.optim.Adam(net.parameters(), lr=1e-2))
    result = train(fabric, net, opt, plugin)
    result["weight_dtype"] = str(net.module[0].weight.dtype)
    result["scale"] = plugin.loss_scaler.get_scale()
    result["comm"] = dict(plugin.comm_counter.by_dtype)
    return result


def ddp_resume(out: Path) -> dict:
    """fabric.save at step 2 and fabric.load into a fresh Fabric, as the single-process test, under DDP."""
    def fresh():
        plugin = MixedPrecision("bf16-master")
        fabric = Fabric(accelerator="cpu", devices=2, strategy=DDPStrategy(), plugins=[plugin])
        fabric.launch()
        net = model()
        net, opt = fabric.setup(net, torch.optim.Adam(net.parameters(), lr=1e-2))
        return plugin, fabric, net, opt

    def run(fabric, net, opt, part):
        for x, y in part:
            fabric.backward(F.mse_loss(net(x), y))
            opt.step()
            opt.zero_grad()

    data = batches()
    plugin, fabric, net, opt = fresh()
    run(fabric, net, opt, data)
    whole = snapshot(net.module, opt.optimizer, plugin)
    plugin, fabric, net, opt = fresh()
    run(fabric, net, opt, data[:2])
    path = out / "ddp_resume.ckpt"
    fabric.save(path, {"model": net, "optimizer": opt, "mp": plugin})
    plugin, fabric, net, opt = fresh()
    plugin.setup_optimizers(opt)  # the masters in the optimizer before its state loads
    fabric.load(path, {"model": net, "optimizer": opt, "mp": plugin})
    run(fabric, net, opt, data[2:])
    return {"whole": whole, "resumed": snapshot(net.module, opt.optimizer, plugin)}


def fsdp_skip(out: Path) -> dict:
    plugin = MixedPrecision("bf16-master")  # no loss scaling; non-finite gradients still skip the step

    def parallelize(module: nn.Module, mesh) -> nn.Module:
        return fully_shard_model(module, plugin, mesh["data_parallel"], units=["Linear"])

    strategy = ModelParallelStrategy(parallelize_fn=parallelize, data_parallel_size=2, tensor_parallel_size=1)
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy, plugins=[plugin])
    fabric.launch()
    net = fabric.setup_module(model())
    opt = fabric.setup_optimizers(torch.optim.Adam(net.parameters(), lr=1e-2))
    monitor = FabricMonitor(log_every_n_steps=1, log_memory=False)
    monitor.attach(fabric, net)  # setup_module + setup_optimizers: Fabric calls no on_after_setup
    result = train(fabric, net, opt, plugin)
    monitor.detach()
    result["history"] = [(s.step, s.overflow, s.skipped_total, s.grad_norm) for s in monitor.history]
    result["sharded"] = plugin.sharded is not None and plugin.sharded.n_shards
    result["masters"] = len(plugin.masters)
    result["param_types"] = sorted({f"{type(p).__name__} {p.dtype}" for p in net.parameters()})
    result["full"] = {n: p.full_tensor().detach().clone() for n, p in net.module.named_parameters()}
    return result


SCENARIOS = {"ddp_skip": ddp_skip, "ddp_resume": ddp_resume, "fsdp_skip": fsdp_skip}


def worker(out: str) -> None:
    """Every scenario in turn (in a rank of helpers/torchrun.py's launch, which made the rank quiet)."""
    for name, scenario in SCENARIOS.items():
        torch.save(scenario(Path(out)), Path(out) / f"{name}_rank{rank()}.pt")
