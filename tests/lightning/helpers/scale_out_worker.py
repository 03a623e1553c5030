"""Two-process scenarios of tests/lightning/test_scale_out.py: ``worker(out)``, run in the test run's one
torchrun launch (helpers/torchrun.py).

Each rank runs every scenario in turn (Lightning's ModelParallelStrategy and DDPStrategy take the
processes torchrun made) and saves plain data to ``OUT/<scenario>_rank<r>.pt``; the test file asserts.
Scenarios: FSDP2 overflow on one rank against torch's ShardedGradScaler driving the same model
(``fsdp_skip``, with the monitor), bytes per parameter per rank (``fsdp_memory``), resume through
Lightning's distributed checkpoint against an uninterrupted run (``fsdp_resume``), the checks of a
model sharded against the recipe (``fsdp_refused``), and DDP communication dtypes (``ddp_comm``).
"""

from __future__ import annotations

import os
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler

from lightning_ext import MixedPrecision, MixedPrecisionMonitor
from lightning_ext.diagnostics import grad_norm, underflow_counts
from lightning_ext.distributed import CommCounter, fully_shard_model, local
from tests.lightning.helpers.models import regression_data, trainer_kwargs

SCALER = {"init_scale": 2.0**8, "growth_interval": 3}
INF_STEP = 2  # rank 1's gradient shard gets an inf after the reduce-scatter
BOOST_STEP = 2  # rank 0's FP32 gradient is multiplied by 1e6 before DDP's reduction
BATCH, STEPS = 8, 6
DATA = 2 * 3 * BATCH  # 3 batches per rank per epoch


def rank() -> int:
    return int(os.environ["RANK"])


class Sharded(pl.LightningModule):
    """Linear-ReLU-Linear, sharded in configure_model with the plugin's recipe; optional inf/hook injection."""

    def __init__(self, optimizer: str = "adam", inf_steps=(), inf_rank: int = 1, shard: bool = True,
                 norm: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16) if norm else nn.Identity(), nn.ReLU(),
                                 nn.Linear(16, 2))
        self.optimizer_name, self.inf_steps, self.inf_rank, self.shard = optimizer, set(inf_steps), inf_rank, shard
        self.gathered: list[tuple[int, list, list]] = []
        self.norm_gathered: list[list[str]] = []
        self.losses: list[float] = []

    def configure_model(self) -> None:
        if self.shard and not hasattr(self.net, "_get_fsdp_state"):
            fully_shard_model(self.net, self.trainer.precision_plugin.recipe, self.device_mesh["data_parallel"],
                              units=["Linear"])
            self.net[3].register_forward_pre_hook(self._record_gather)  # runs after FSDP2's (the all-gather)
            self.net[1].register_forward_hook(  # the norm computed with FP32 weights, output FP32
                lambda m, a, out: self.norm_gathered.append(sorted({str(p.dtype) for p in m.parameters()} |
                                                                   {f"out {out.dtype}"})))

    def _record_gather(self, module, args) -> None:  # what a unit holds gathered while it computes
        held = [(p.numel() * p.element_size(), str(p.dtype).replace("torch.", ""), type(p).__name__)
                for p in module.parameters()]
        self.gathered.append((sum(b for b, _, _ in held), sorted({d for _, d, _ in held}),
                              sorted({t for _, _, t in held})))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.net(x).float(), y[:, :1].expand(-1, 2))
        self.losses.append(float(loss))
        return loss

    def on_after_backward(self) -> None:
        if self.trainer.global_step in self.inf_steps and rank() == self.inf_rank:
            local(next(iter(self.net.parameters())).grad).view(-1)[0] = float("inf")

    def configure_optimizers(self):
        cls = torch.optim.AdamW if self.optimizer_name == "adamw" else torch.optim.Adam
        return cls(self.parameters(), lr=1e-2)


def loader() -> DataLoader:
    """This rank's half of the data, in order (the trainers take it as is: use_distributed_sampler=False)."""
    data = regression_data(DATA, 8)
    return DataLoader(data, batch_size=BATCH, sampler=DistributedSampler(data, 2, rank(), shuffle=False))


def snapshot(module: nn.Module, optimizer) -> dict:
    """This rank's local shards of the parameters and of every optimizer state tensor."""
    params = {n: local(p).detach().clone() for n, p in module.named_parameters()}
    names = {id(p): n for n, p in module.named_parameters()}
    states = {f"{names[id(p)]}.{k}": local(v).detach().clone() for p, s in optimizer.state.items()
              for k, v in s.items() if torch.is_tensor(v)}
    return {"params": params, "states": states}


class Record(pl.Callback):
    """Per step: local shards around the optimizer step, the scale; the global grad norm from full tensors."""

    def __init__(self) -> None:
        self.steps: list[dict] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        grads = [p.grad.full_tensor() for p in pl_module.parameters()]  # collective: every rank calls it
        scale = trainer.precision_plugin.loss_scaler.grad_scale
        lost, total = underflow_counts(grads, "float16", scale)
        self.steps.append({"before": snapshot(pl_module.net, optimizer), "grad_norm": float(grad_norm(grads)),
                           "underflow": (int(lost), int(total)), "scale": float(scale)})

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.steps[-1]["after"] = snapshot(pl_module.net, trainer.optimizers[0])


def fsdp_trainer(plugin, out: Path, **kw) -> pl.Trainer:
    strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
    return pl.Trainer(plugins=[plugin], strategy=strategy, use_distributed_sampler=False,
                      **trainer_kwargs(devices=2, **kw))


def count_collectives(scaler) -> list:
    """Wrap the scaler's overflow check: per step, the (collective, bytes) it issues (dist and DTensor's funcol)."""
    import torch.distributed._functional_collectives as funcol

    per_step: list = []
    check = scaler.unscale_once

    def counted(*args, **kwargs):
        calls: list = []
        originals = (dist.all_reduce, funcol.all_reduce)

        def spy(name, fn):
            def wrapper(tensor, *a, **k):
                calls.append((name, tensor.numel() * tensor.element_size()))
                return fn(tensor, *a, **k)
            return wrapper

        dist.all_reduce, funcol.all_reduce = spy("all_reduce", originals[0]), spy("funcol.all_reduce", originals[1])
        try:
            return check(*args, **kwargs)
        finally:
            dist.all_reduce, funcol.all_reduce = originals
            per_step.append(calls)

    scaler.unscale_once = counted
    return per_step


def fsdp_skip(out: Path) -> dict:
    record = Record()
    monitor = MixedPrecisionMonitor(log_every_n_steps=1, meter_samples=None, log_memory=False)
    model = Sharded(inf_steps={INF_STEP})
    plugin = MixedPrecision("16-master", scaler=SCALER)
    collectives = count_collectives(plugin.loss_scaler)
    trainer = fsdp_trainer(plugin, out, max_steps=STEPS, callbacks=[monitor, record],
                           logger=CSVLogger(str(out / "logs"), name="fsdp"))
    trainer.fit(model, loader())
    scaler = trainer.precision_plugin.loss_scaler
    return {"steps": record.steps, "history": [s.metrics() | {"step": s.step} for s in monitor.history],
            "skipped": scaler.skipped, "overflows": scaler.overflows, "scale": scaler.get_scale(),
            "consensus": collectives,
            "reference": sharded_grad_scaler_reference(trainer.precision_plugin, model.net[0].weight.device_mesh)}


def sharded_grad_scaler_reference(plugin, mesh) -> dict:
    """The same model, data, sharding and injection in a plain loop with torch's ShardedGradScaler."""
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    model = Sharded(shard=False).net
    fully_shard_model(model, plugin.recipe, mesh, units=["Linear"])
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    scaler = ShardedGradScaler("cpu", init_scale=SCALER["init_scale"], growth_interval=SCALER["growth_interval"])
    batches = list(loader())
    steps = []
    for step in range(STEPS):
        x, y = batches[step % len(batches)]
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.mse_loss(model(x).float(), y[:, :1].expand(-1, 2))
        scaler.scale(loss).backward()
        if step == INF_STEP and rank() == 1:
            local(next(iter(model.parameters())).grad).view(-1)[0] = float("inf")
        scaler.unscale_(opt)
        norm = float(grad_norm([p.grad.full_tensor() for p in model.parameters()]))
        scaler.step(opt)
        scaler.update()
        steps.append({"scale": float(scaler.get_scale()), "grad_norm": norm, "loss": float(loss),
                      **snapshot(model, opt)})
    return {"steps": steps}


def fsdp_memory(out: Path) -> dict:
    monitor = MixedPrecisionMonitor(log_every_n_steps=1000, log_memory=True)
    model = Sharded(optimizer="adamw", norm=True)  # the LayerNorm is a unit of its own, gathered in FP32
    plugin = MixedPrecision("bf16-master", comm_dtype="bfloat16")  # FSDP2 reduce-scatters in bf16
    trainer = fsdp_trainer(plugin, out, max_steps=2, callbacks=[monitor])
    trainer.fit(model, loader())
    opt = trainer.optimizers[0]
    return {"report": monitor.memory_reports[-1], "gathered": model.gathered,
            "unit_numel": sum(p.numel() for p in model.net[3].parameters()),
            "norm_numel": sum(p.numel() for p in model.net[1].parameters()),
            "norm_gathered": model.norm_gathered,
            "param_types": sorted({type(p).__name__ for p in model.parameters()}),
            "state_dtypes": sorted({str(local(v).dtype) for s in opt.state.values() for v in s.values()
                                    if torch.is_tensor(v) and v.dim()}),
            "plugin_masters": len(trainer.precision_plugin.masters)}


def fsdp_resume(out: Path) -> dict:
    """16-master for 2 epochs of 3 steps (an overflow on rank 1 at step 4) uninterrupted, and 1 epoch saved
    through Lightning's distributed checkpoint then resumed for the second (the existing resume tests' shape)."""
    def run(epochs: int, ckpt=None, save=None):
        model = Sharded(inf_steps={4})
        trainer = fsdp_trainer(MixedPrecision("16-master", scaler=SCALER), out, max_epochs=epochs)
        trainer.fit(model, loader(), ckpt_path=ckpt)
        if save is not None:
            trainer.save_checkpoint(save)
        s = trainer.precision_plugin.loss_scaler
        return {**snapshot(model.net, trainer.optimizers[0]), "scale": s.get_scale(), "skipped": s.skipped,
                "steps": s.steps, "global_step": trainer.global_step, "losses": model.losses}

    path = out / "ckpt"
    whole = run(2)
    run(1, save=path)
    resumed = run(2, ckpt=path)
    return {"whole": whole, "resumed": resumed, "ckpt_files": sorted(p.name for p in path.iterdir())}


def fsdp_refused(out: Path) -> dict:
    errors = {}
    for name, recipe, shard in [("unsharded_master", "bf16-master", False), ("kahan", "bf16-kahan", True),
                                ("wrong_policy", "bf16-master", "fp32")]:
        model = Sharded(shard=shard is True)
        if shard == "fp32":  # sharded with FSDP2's default policy (no casts): not what bf16-master needs
            def configure(m=model):
                from torch.distributed.fsdp import fully_shard
                if not hasattr(m.net, "_get_fsdp_state"):
                    fully_shard(m.net, mesh=m.device_mesh["data_parallel"])
            model.configure_model = configure
        try:
            fsdp_trainer(MixedPrecision(recipe), out, max_steps=1).fit(model, loader())
            errors[name] = None
        except Exception as exc:  # noqa: BLE001 - the message is what the test reads
            errors[name] = f"{type(exc).__name__}: {exc}"
    return errors


class Plain(pl.LightningModule):
    """DDP model; ``boost`` multiplies the first weight's gradient on rank 0 at one step, before the reduction."""

    def __init__(self, boost_step: int | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
        self.boost_step = boost_step
        self.net[0].weight.register_hook(self._boost)
        self.losses: list[float] = []

    def _boost(self, grad):
        if self.trainer.global_step == self.boost_step and rank() == 0:
            return grad * 1e6  # finite in FP32; beyond float16's range once cast for the reduction
        return grad

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.net(x).float(), y)
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-2)


def ddp_comm(out: Path) -> dict:
    results = {}
    for comm in ("float32", "bfloat16", "float16"):
        for counted, boost in ((False, None), (True, None), (False, BOOST_STEP)):
            plugin = MixedPrecision("16-mixed", scaler=SCALER, comm_dtype=comm)
            plugin.comm_counter = CommCounter() if counted else None
            model = Plain(boost)
            trainer = pl.Trainer(plugins=[plugin], strategy=DDPStrategy(), max_steps=4, callbacks=[Skips()],
                                 use_distributed_sampler=False, **trainer_kwargs(devices=2))
            trainer.fit(model, loader())
            results[(comm, counted, boost)] = {
                "params": {n: p.detach().clone() for n, p in model.named_parameters()},
                "skips": trainer.callbacks[0].skips, "scale": plugin.loss_scaler.get_scale(), "losses": model.losses,
                "bytes": None if not counted else plugin.comm_counter.total_bytes,
                "by_dtype": None if not counted else plugin.comm_counter.by_dtype,
                "numel": sum(p.numel() for p in model.parameters())}
    for comm in ("float32", "bfloat16"):  # *-master: DDP's buckets hold bf16 gradients
        plugin = MixedPrecision("bf16-master", comm_dtype=comm)
        plugin.comm_counter = CommCounter()
        model = Plain()
        pl.Trainer(plugins=[plugin], strategy=DDPStrategy(), max_steps=2, use_distributed_sampler=False,
                   **trainer_kwargs(devices=2)).fit(model, loader())
        results[("bf16-master", comm)] = {"by_dtype": plugin.comm_counter.by_dtype,
                                          "numel": sum(p.numel() for p in model.parameters()),
                                          "masters": {k: v.clone() for k, v in plugin.master_state_dict().items()}}
    return results


class Skips(pl.Callback):
    """Which steps the plugin skipped."""

    def __init__(self) -> None:
        self.skips: list[bool] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.skips.append(trainer.precision_plugin.last_step_skipped())


SCENARIOS = {"fsdp_skip": fsdp_skip, "fsdp_memory": fsdp_memory, "fsdp_resume": fsdp_resume,
             "fsdp_refused": fsdp_refused, "ddp_comm": ddp_comm}


def worker(out: str) -> None:
    """Every scenario in turn (in a rank of helpers/torchrun.py's launch, which made the rank quiet)."""
    for name, scenario in SCENARIOS.items():
        torch.save(scenario(Path(out)), Path(out) / f"{name}_rank{rank()}.pt")
