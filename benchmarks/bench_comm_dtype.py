"""Communication precision on 2 processes, DDP and FSDP2: bytes per step (counted) and the loss against FP32.

    python benchmarks/bench_comm_dtype.py [--strategy ddp fsdp2] [--steps 200] [--hidden 256] [--depth 2]
                                          [--batch-size 64] [--recipes 16-mixed bf16-mixed bf16-master] [--json PATH]

Launches itself with torchrun (2 CPU processes, gloo) unless already under it.  For each strategy, recipe
and ``comm_dtype`` (float32, bfloat16, float16) it trains the same MLP on scikit-learn's digits with the
same seed and the same per-rank batches through ``lightning_ext.MixedPrecision(recipe, comm_dtype=...)``,
with ``plugin.comm_counter = CommCounter()`` (``lightning_ext.distributed``): bytes are counted, not estimated.

* ``ddp`` (Lightning's DDPStrategy): the gradient all-reduce goes through the counting hook; the bytes are
  those handed to ``all_reduce`` per bucket, next to the core's ``allreduce_bytes``.
* ``fsdp2`` (``ModelParallelStrategy``, torch ``fully_shard``; every Linear its own unit, the recipe's
  ``MixedPrecisionPolicy`` from ``fully_shard_model``, whose ``reduce_dtype`` is the ``comm_dtype``):
  every unit's reduce-scatter (the unsharded gradients it is handed) and all-gather (the unsharded
  parameters it fills) is counted, by dtype, next to the core's ``fsdp_step_bytes``.

Losses: the mean over both ranks of every step's loss, the largest per-step difference against the
FP32-communication run of the same strategy and recipe, and the final loss of the whole training set
computed in FP32 from the trained FP32 weights (the masters under ``*-master``; FSDP2's FP32 shards,
gathered).  Also printed: the CPU model, the steps skipped (an fp16 reduction of loss-scaled gradients
can overflow) and the overflow consensus' cost (one all-reduce of one float32 per step).  No thresholds.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import bytes_by_dtype, machine_line, quiet_torch_worker, torchrun_self, write_json  # noqa: E402

COMMS = ("float32", "bfloat16", "float16")


def parse(argv: list[str]):
    import argparse

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=64, help="per rank")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--recipes", nargs="+", default=["16-mixed", "bf16-mixed", "bf16-master"])
    parser.add_argument("--strategy", nargs="+", default=["ddp", "fsdp2"], choices=["ddp", "fsdp2"])
    parser.add_argument("--json", default=None, metavar="PATH")
    return parser.parse_args(argv)


def run_one(strategy: str, recipe: str, comm: str, args, data) -> dict:
    import lightning.pytorch as pl
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy
    from torch import nn
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    from lightning_ext import CommCounter, MixedPrecision
    from lightning_ext.distributed import fsdp_comm_units
    from lightning_ext.fsdp import fully_shard_model
    from mp_callbacks.memory import allreduce_bytes, fsdp_step_bytes

    x, y = data

    class MLP(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            layers, width = [], x.shape[1]
            for _ in range(args.depth):
                layers += [nn.Linear(width, args.hidden), nn.ReLU()]
                width = args.hidden
            self.net = nn.Sequential(*layers, nn.Linear(width, 10))
            self.losses: list[torch.Tensor] = []

        def configure_model(self) -> None:
            if strategy == "fsdp2" and not hasattr(self.net, "_get_fsdp_state"):
                fully_shard_model(self.net, self.trainer.precision_plugin.recipe, self.device_mesh["data_parallel"],
                                  units=["Linear"])

        def training_step(self, batch, batch_idx):
            loss = F.cross_entropy(self.net(batch[0]).float(), batch[1])
            self.losses.append(loss.detach().float())
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=args.lr)

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])  # Lightning starts the group in fit
    data_set = TensorDataset(x, y)
    sampler = DistributedSampler(data_set, world, rank, shuffle=True, seed=0)
    loader = DataLoader(data_set, batch_size=args.batch_size, sampler=sampler, drop_last=True)
    plugin = MixedPrecision(recipe, comm_dtype=comm)
    plugin.comm_counter = CommCounter()
    model = MLP()
    chosen = DDPStrategy() if strategy == "ddp" else ModelParallelStrategy(data_parallel_size=world,
                                                                           tensor_parallel_size=1)
    trainer = pl.Trainer(accelerator="cpu", devices=world, strategy=chosen, plugins=[plugin],
                         max_steps=args.steps, use_distributed_sampler=False, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, loader)
    losses = torch.stack(model.losses)
    dist.all_reduce(losses)
    if strategy == "ddp":
        masters = plugin.master_state_dict()
        weights = {k: masters.get(f"net.{k}", v) for k, v in model.net.state_dict().items()}
        core = {"all_reduce": {comm: allreduce_bytes(sum(p.numel() for p in model.parameters()), comm)}}
    else:  # the FP32 shards (the masters under *-master), gathered: a collective, every rank calls it
        weights = {k: v.full_tensor() for k, v in model.net.state_dict().items()}
        core = fsdp_step_bytes(*fsdp_comm_units(model))
    with torch.no_grad():  # the whole training set, in FP32, from the FP32 weights
        net = MLP().net
        net.load_state_dict({k: v.float() for k, v in weights.items()})
        final = float(F.cross_entropy(net(x), y))
    steps = trainer.global_step
    counted = {op: {d: b / steps for d, b in per.items()} for op, per in plugin.comm_counter.by_op.items()}
    return {"losses": (losses / world).tolist(), "final_loss": final, "counted": counted, "core": core,
            "calls": plugin.comm_counter.calls / steps, "skipped": plugin.loss_scaler.skipped, "steps": steps}


def worker(argv: list[str]) -> None:
    import torch
    import torch.distributed as dist

    from mp_callbacks.app.compare import digits_data
    from mp_callbacks.memory import consensus_cost

    quiet_torch_worker()
    args = parse(argv)
    x, y, _, _ = digits_data()
    data = (torch.from_numpy(x), torch.from_numpy(y))
    results = {(strategy, recipe): {comm: run_one(strategy, recipe, comm, args, data) for comm in COMMS}
               for strategy in args.strategy for recipe in args.recipes}
    if dist.get_rank() != 0:
        return
    world = dist.get_world_size()
    numel = sum(64 * args.hidden if i == 0 else args.hidden * args.hidden for i in range(args.depth))
    numel += args.depth * args.hidden + args.hidden * 10 + 10
    print(machine_line(1))
    print(f"2 processes (gloo), MLP 64-{'-'.join([str(args.hidden)] * args.depth)}-10 ({numel:,} parameters), "
          f"{args.steps} steps, batch {args.batch_size} per rank, AdamW lr {args.lr}; bytes per optimizer step, "
          "counted (core estimate in brackets)")
    rows = []
    for (strategy, recipe), by_comm in results.items():
        base = by_comm["float32"]
        ops = ("all_reduce",) if strategy == "ddp" else ("reduce_scatter", "all_gather")
        print(f"\n{strategy} {recipe}:")
        print(f"  {'comm_dtype':<10} " + " ".join(f"{op + ' (core)':>40}" for op in ops)
              + f" {'skipped':>7} {'final loss':>11} {'vs fp32':>10} {'max |dloss| per step':>21}")
        for comm, r in by_comm.items():
            diff = max(abs(a - b) for a, b in zip(r["losses"], base["losses"]))
            cells = [f"{bytes_by_dtype(r['counted'].get(op, {}))} ({bytes_by_dtype(r['core'].get(op, {}))})"
                     for op in ops]
            print(f"  {comm:<10} " + " ".join(f"{c:>40}" for c in cells)
                  + f" {r['skipped']:>7d} {r['final_loss']:>11.5f} {r['final_loss'] - base['final_loss']:>+10.5f}"
                  f" {diff:>21.5f}")
            rows.append({"strategy": strategy, "recipe": recipe, "comm_dtype": comm, "counted_per_step": r["counted"],
                         "core_per_step": r["core"], "calls_per_step": r["calls"], "skipped": r["skipped"],
                         "final_loss": r["final_loss"], "final_loss_vs_fp32": r["final_loss"] - base["final_loss"],
                         "max_step_loss_diff": diff, "numel": numel})
    cost = consensus_cost(world)
    print(f"\noverflow consensus: {cost['collectives']} all-reduce of {cost['payload_bytes']} bytes per step "
          f"(ring: {cost['ring_bytes_per_rank']:.1f} bytes sent per rank; not in the counts above)")
    write_json(args.json, rows)


def main() -> None:
    torchrun_self(__file__, worker)


if __name__ == "__main__":
    main()
