"""Communication precision under DDP on 2 processes: bytes all-reduced per step and the loss against FP32.

    python benchmarks/bench_comm_dtype.py [--steps 200] [--hidden 256] [--depth 2] [--batch-size 64]
                                          [--recipes 16-mixed bf16-master] [--json PATH]

Launches itself with torchrun (2 CPU processes, gloo) unless already under it.  For each recipe and
each ``comm_dtype`` (float32, bfloat16, float16) it trains the same MLP on scikit-learn's digits with
the same seed and the same per-rank batches through ``lightning_ext.MixedPrecision(recipe,
comm_dtype=...)`` under Lightning's DDPStrategy.  The gradient all-reduce goes through
``lightning_ext.comm``'s counting hook (``plugin.comm_counter``): the bytes are those handed to
``all_reduce``, counted per bucket, not estimated; the core's figure (``allreduce_bytes``) is printed
beside them.  Losses: the mean over both ranks of every step's loss, the largest per-step
difference against the FP32-communication run, and the final loss of the whole training set computed
in FP32 from the trained FP32 weights (the masters under ``*-master``).  Also printed: the CPU model,
the steps skipped (an fp16 reduction of loss-scaled gradients can overflow) and the overflow
consensus' cost (one all-reduce of one float32 per step).  No thresholds: figures only.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import machine_line, write_json  # noqa: E402

COMMS = ("float32", "bfloat16", "float16")


def parse(argv: list[str]):
    import argparse

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=64, help="per rank")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--recipes", nargs="+", default=["16-mixed", "bf16-master"])
    parser.add_argument("--json", default=None, metavar="PATH")
    return parser.parse_args(argv)


def run_one(recipe: str, comm: str, args, data) -> dict:
    import lightning.pytorch as pl
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from lightning.pytorch.strategies import DDPStrategy
    from torch import nn
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    from lightning_ext import CommCounter, MixedPrecision

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
    trainer = pl.Trainer(accelerator="cpu", devices=world, strategy=DDPStrategy(), plugins=[plugin],
                         max_steps=args.steps, use_distributed_sampler=False, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, loader)
    losses = torch.stack(model.losses)
    dist.all_reduce(losses)
    masters = plugin.master_state_dict()
    with torch.no_grad():  # the whole training set, in FP32, from the FP32 weights
        net = MLP().net
        net.load_state_dict({k: masters.get(f"net.{k}", v).float() for k, v in model.net.state_dict().items()})
        final = float(F.cross_entropy(net(x), y))
    numel = sum(p.numel() for p in model.parameters())
    return {"losses": (losses / world).tolist(), "final_loss": final, "bytes": plugin.comm_counter.total_bytes,
            "by_dtype": plugin.comm_counter.by_dtype, "calls": plugin.comm_counter.calls, "numel": numel,
            "skipped": plugin.loss_scaler.skipped, "steps": trainer.global_step}


def worker(argv: list[str]) -> None:
    import logging
    import warnings

    import lightning.pytorch  # noqa: F401 - it sets its loggers' levels on import: quiet them after
    import torch
    import torch.distributed as dist

    from mp_callbacks.compare import digits_data
    from mp_callbacks.sharding import allreduce_bytes, consensus_cost

    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    logging.getLogger("lightning.fabric").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    args = parse(argv)
    x, y, _, _ = digits_data()
    data = (torch.from_numpy(x), torch.from_numpy(y))
    results = {recipe: {comm: run_one(recipe, comm, args, data) for comm in COMMS} for recipe in args.recipes}
    if dist.get_rank() != 0:
        return
    world = dist.get_world_size()
    print(machine_line(1))
    print(f"DDP on {world} processes (gloo), MLP 64-{'-'.join([str(args.hidden)] * args.depth)}-10, "
          f"{args.steps} steps, batch {args.batch_size} per rank, AdamW lr {args.lr}")
    rows = []
    for recipe, by_comm in results.items():
        base = by_comm["float32"]
        print(f"\n{recipe}:")
        print(f"  {'comm_dtype':<10} {'bytes/step counted':>19} {'core figure':>12} {'calls/step':>10} "
              f"{'skipped':>7} {'final loss':>11} {'vs fp32':>10} {'max |dloss| per step':>21}")
        for comm, r in by_comm.items():
            per_step = r["bytes"] / r["steps"]
            paper = allreduce_bytes(r["numel"], comm)
            diff = max(abs(a - b) for a, b in zip(r["losses"], base["losses"]))
            print(f"  {comm:<10} {per_step:>19.0f} {paper:>12d} {r['calls'] / r['steps']:>10.1f} {r['skipped']:>7d} "
                  f"{r['final_loss']:>11.5f} {r['final_loss'] - base['final_loss']:>+10.5f} {diff:>21.5f}")
            rows.append({"recipe": recipe, "comm_dtype": comm, "bytes_per_step": per_step, "core_bytes": paper,
                         "by_dtype": r["by_dtype"], "skipped": r["skipped"], "final_loss": r["final_loss"],
                         "final_loss_vs_fp32": r["final_loss"] - base["final_loss"], "max_step_loss_diff": diff,
                         "numel": r["numel"]})
    cost = consensus_cost(world)
    print(f"\noverflow consensus: {cost['collectives']} all-reduce of {cost['payload_bytes']} bytes per step "
          f"(ring: {cost['ring_bytes_per_rank']:.1f} bytes sent per rank)")
    write_json(args.json, rows)


def main() -> None:
    if "LOCAL_RANK" in os.environ:
        worker(sys.argv[1:])
        return
    import socket

    with socket.socket() as sock:  # a free port for the rendezvous
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={port}",
           str(Path(__file__).resolve()), *sys.argv[1:]]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    sys.exit(subprocess.run(cmd, cwd=ROOT, env=env).returncode)


if __name__ == "__main__":
    main()
