"""FP8 all-gather under FSDP2 on 2 processes: all-gather bytes per step, FP8 next to bf16, and the loss.

    python benchmarks/bench_fp8_allgather.py [--steps 200] [--hidden 256] [--depth 2] [--batch-size 64]
                                             [--lr 1e-3] [--json PATH]

Launches itself with torchrun (2 CPU processes, gloo) unless already under it.  Trains the same MLP on
scikit-learn's digits (every Linear its own FSDP2 unit, ``lightning_ext.fsdp.fully_shard_model``, Lightning's
``ModelParallelStrategy``) with the same seed and per-rank batches, ``plugin.comm_counter = CommCounter()``
counting what each unit's all-gather and reduce-scatter is handed (bytes counted, not estimated):

* ``fp8-mixed`` with current scaling (``preset="torchao"``) and with delayed scaling (the default), each
  gathering bf16 and with ``fp8={"fsdp_float8_all_gather": True}`` (weights as e4m3 bytes, biases bf16:
  one ``uint8`` buffer per unit);
* ``bf16-master`` (no FP8 matmuls): FP8's own distance from bf16 training;
* torchao (reference): ``convert_to_float8_training(net, Float8LinearConfig(enable_fsdp_float8_all_gather=True,
  emulate=True))`` on the same net, sharded the same way, a plain loop with AdamW: its bytes per step.

Printed: the CPU model, per run the all-gather and reduce-scatter bytes per step (the core's
``fsdp_step_bytes`` in brackets), the FP8/bf16 all-gather ratio, the final training-set loss (FP32, from the
gathered FP32 shards) and the largest per-step loss difference against the bf16-gather run, and the amax
all-reduces current scaling adds (one float32 per FP8 weight per gather; not in the counts).  No thresholds.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import bytes_by_dtype, machine_line, quiet_torch_worker, torchrun_self, write_json  # noqa: E402

RUNS = {  # name: (recipe, fp8 settings, FP8 all-gather)
    "current bf16-gather": ("fp8-mixed", {"preset": "torchao"}, False),
    "current fp8-gather": ("fp8-mixed", {"preset": "torchao"}, True),
    "delayed bf16-gather": ("fp8-mixed", {}, False),
    "delayed fp8-gather": ("fp8-mixed", {}, True),
    "bf16-master": ("bf16-master", None, False),
}


def parse(argv: list[str]):
    import argparse

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=64, help="per rank")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--json", default=None, metavar="PATH")
    return parser.parse_args(argv)


def make_net(args, width: int):
    import torch
    from torch import nn

    torch.manual_seed(0)
    layers = []
    for _ in range(args.depth):
        layers += [nn.Linear(width, args.hidden), nn.ReLU()]
        width = args.hidden
    return nn.Sequential(*layers, nn.Linear(width, 10))


def loader(data, args):
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    data_set = TensorDataset(*data)
    sampler = DistributedSampler(data_set, world, rank, shuffle=True, seed=0)
    return DataLoader(data_set, batch_size=args.batch_size, sampler=sampler, drop_last=True)


def final_loss(net, data, args) -> float:
    """The whole training set in FP32 from the FP32 shards, gathered (a collective: every rank calls it)."""
    import torch
    import torch.nn.functional as F

    weights = {k: v.full_tensor() for k, v in net.state_dict().items()}
    with torch.no_grad():
        plain = make_net(args, data[0].shape[1])
        plain.load_state_dict({k: v.float() for k, v in weights.items()})
        return float(F.cross_entropy(plain(data[0]), data[1]))


def run_one(recipe: str, settings: dict | None, gather: bool, args, data) -> dict:
    import lightning.pytorch as pl
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from lightning.pytorch.strategies import ModelParallelStrategy

    from lightning_ext import CommCounter, MixedPrecision
    from lightning_ext.distributed import fsdp_comm_units
    from lightning_ext.fsdp import fully_shard_model
    from mp_callbacks.memory import fsdp_step_bytes

    class MLP(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = make_net(args, data[0].shape[1])
            self.losses: list[torch.Tensor] = []

        def configure_model(self) -> None:
            if not hasattr(self.net, "_get_fsdp_state"):
                fully_shard_model(self.net, self.trainer.precision_plugin.recipe, self.device_mesh["data_parallel"],
                                  units=["Linear"])

        def training_step(self, batch, batch_idx):
            loss = F.cross_entropy(self.net(batch[0]).float(), batch[1])
            self.losses.append(loss.detach().float())
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=args.lr)

    world = int(os.environ["WORLD_SIZE"])
    fp8 = None if settings is None else {**settings, "fsdp_float8_all_gather": gather}
    plugin = MixedPrecision(recipe, fp8=fp8)
    plugin.comm_counter = CommCounter()
    model = MLP()
    trainer = pl.Trainer(accelerator="cpu", devices=world, plugins=[plugin], max_steps=args.steps,
                         strategy=ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1),
                         use_distributed_sampler=False, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, loader(data, args))
    losses = torch.stack(model.losses)
    dist.all_reduce(losses)
    steps = trainer.global_step
    counted = {op: {d: b / steps for d, b in per.items()} for op, per in plugin.comm_counter.by_op.items()}
    units, shards = fsdp_comm_units(model)
    gathers = sum(g for _, _, _, g in units)  # gathers per step of the units (all FP8 Linear units here)
    return {"losses": (losses / world).tolist(), "final_loss": final_loss(model.net, data, args), "counted": counted,
            "core": fsdp_step_bytes(units, shards), "steps": steps, "skipped": plugin.loss_scaler.skipped,
            "amax_allreduce_bytes": 4 * gathers if gather and settings.get("preset") == "torchao" else 0}


def run_torchao(args, data) -> dict:
    import torch
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    from lightning_ext import CommCounter, MixedPrecision
    from lightning_ext.distributed import count_fsdp_collectives
    from lightning_ext.fsdp import fsdp_policy

    net = make_net(args, data[0].shape[1])
    convert_to_float8_training(net, config=Float8LinearConfig(enable_fsdp_float8_all_gather=True, emulate=True))
    recipe = MixedPrecision("fp8-mixed").recipe
    mesh = init_device_mesh("cpu", (int(os.environ["WORLD_SIZE"]),))
    for layer in net:
        if any(True for _ in layer.parameters()):
            fully_shard(layer, mesh=mesh, mp_policy=fsdp_policy(recipe, root=False))
    fully_shard(net, mesh=mesh, mp_policy=fsdp_policy(recipe))
    counter = CommCounter()
    count_fsdp_collectives(net, counter)
    optimizer = torch.optim.AdamW(net.parameters(), lr=args.lr)
    steps = 0
    while steps < args.steps:
        for x, y in loader(data, args):
            F.cross_entropy(net(x).float(), y).backward()
            optimizer.step()
            optimizer.zero_grad()
            steps += 1
            if steps == args.steps:
                break
    return {"counted": {op: {d: b / steps for d, b in per.items()} for op, per in counter.by_op.items()},
            "steps": steps}


def worker(argv: list[str]) -> None:
    import torch
    import torch.distributed as dist

    from mp_callbacks.app.compare import digits_data

    quiet_torch_worker()
    args = parse(argv)
    x, y, _, _ = digits_data()
    data = (torch.from_numpy(x), torch.from_numpy(y))
    results = {name: run_one(*spec, args, data) for name, spec in RUNS.items()}
    ao = run_torchao(args, data)
    if dist.get_rank() != 0:
        return
    numel = sum(p.numel() for p in make_net(args, x.shape[1]).parameters())
    print(machine_line(1))
    print(f"2 processes (gloo), MLP {x.shape[1]}-{'-'.join([str(args.hidden)] * args.depth)}-10 ({numel:,} "
          f"parameters), every Linear an FSDP2 unit, {args.steps} steps, batch {args.batch_size} per rank, AdamW lr "
          f"{args.lr}; bytes per optimizer step, counted (core estimate in brackets)\n")
    print(f"{'run':<22} {'all-gather (core)':>38} {'vs bf16':>8} {'reduce-scatter':>16} {'amax AR':>8} "
          f"{'skipped':>7} {'final loss':>11} {'max |dloss|':>12}  vs")
    rows = []
    bf16_bytes = sum(results["current bf16-gather"]["counted"]["all_gather"].values())
    for name, r in results.items():
        against = name.replace("fp8-gather", "bf16-gather") if "fp8-gather" in name else "current bf16-gather"
        base = results[against]
        ratio = sum(r["counted"]["all_gather"].values()) / bf16_bytes
        diff = max(abs(a - b) for a, b in zip(r["losses"], base["losses"]))
        cell = f"{bytes_by_dtype(r['counted']['all_gather'])} ({bytes_by_dtype(r['core']['all_gather'])})"
        print(f"{name:<22} {cell:>38} {ratio:>8.4f} {bytes_by_dtype(r['counted']['reduce_scatter']):>16} "
              f"{r['amax_allreduce_bytes']:>8} {r['skipped']:>7d} {r['final_loss']:>11.5f} {diff:>12.5f}  "
              f"{against if base is not r else '-'}")
        rows.append({"run": name, "counted_per_step": r["counted"], "core_per_step": r["core"],
                     "all_gather_vs_bf16": ratio, "amax_allreduce_bytes_per_step": r["amax_allreduce_bytes"],
                     "skipped": r["skipped"], "final_loss": r["final_loss"], "max_step_loss_diff": diff,
                     "loss_diff_against": against})
    ours, theirs = (sum(x["counted"]["all_gather"].values()) for x in (results["current fp8-gather"], ao))
    print(f"{'torchao (reference)':<22} {bytes_by_dtype(ao['counted']['all_gather']):>38} {theirs / bf16_bytes:>8.4f} "
          f"{bytes_by_dtype(ao['counted']['reduce_scatter']):>16}   "
          f"(ours / torchao all-gather bytes: {ours / theirs:.4f})")
    rows.append({"run": "torchao", "counted_per_step": ao["counted"]})
    print("\namax AR: the all-reduce (MAX) of one float32 per FP8 weight per gather that current scaling adds "
          "(bytes per step, not in the all-gather counts); delayed scaling adds none.")
    write_json(args.json, rows)


def main() -> None:
    torchrun_self(__file__, worker)


if __name__ == "__main__":
    main()
