"""How many bytes go on the wire per training step, per recipe and ``comm_dtype``, and what does it do to the loss?

    python benchmarks/scale_out.py [--parts ddp fsdp2 fp8 keras] [--recipes 16-mixed bf16-mixed bf16-master]
        [--comms float32 bfloat16 float16] [--steps 60] [--hidden 256] [--depth 2] [--batch-size 64] [--json PATH]

Two processes on the CPU (Lightning: ``torchrun``, gloo, launched by this script; Keras: two workers of
``tf.distribute.MultiWorkerMirroredStrategy``, ``scale_out_keras.py``), one thread each, the same MLP on
scikit-learn's digits, the same seed and per-rank batches, AdamW lr 1e-3.  Per run: the bytes of one training step
(after two warm-up steps) handed to each collective, by op and dtype, the steps skipped, the largest per-step
difference of the loss (the mean over ranks) from the ``float32``-communication run of the same recipe, and the
last step's loss.

* ``ddp``: Lightning's ``DDPStrategy`` with ``lightning_ext.MixedPrecision(recipe, comm_dtype=...)``, and native
  ``bf16-mixed`` (Lightning's plugin: the FP32 gradients all-reduced as they are);
* ``fsdp2``: ``ModelParallelStrategy`` with every ``Linear`` its own unit (``lightning_ext.fully_shard_model`` with
  the recipe's ``MixedPrecisionPolicy``: ``reduce_dtype`` is the ``comm_dtype``): each unit's all-gather (twice a
  step: forward and backward) and reduce-scatter;
* ``fp8``: FSDP2 ``fp8-mixed`` (current scaling, ``preset="torchao"``, and delayed scaling) gathering bf16 and with
  ``fp8={"fsdp_float8_all_gather": True}`` (weights gathered as e4m3 bytes), next to ``bf16-master``;
* ``keras``: ``keras_ext.master_optimizer(AdamW, recipe)`` with the recipe's ``comm_dtype``.

How the bytes are counted (the same for ours and native): on torch, a ``TorchDispatchMode`` sees every ``c10d`` op
of the step (DDP's bucket all-reduces, FSDP2's all-gathers and reduce-scatters, and any all-reduce of a flag) and
sums the bytes of what each is handed: the tensor all-reduced, the whole (unsharded) buffer an all-gather fills,
the whole buffer a reduce-scatter reduces.  On Keras, the collective ops of the traced step
(``CollectiveReduceV2``...) are read from its graph.  The core's estimates (``mp_callbacks.memory.allreduce_bytes``,
``fsdp_step_bytes``) state the same rule.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

COMMS = ("float32", "bfloat16", "float16")
FP8_RUNS = {"fp8-mixed current, bf16 gather": {"preset": "torchao"},
            "fp8-mixed current, fp8 gather": {"preset": "torchao", "fsdp_float8_all_gather": True},
            "fp8-mixed delayed, bf16 gather": {},
            "fp8-mixed delayed, fp8 gather": {"fsdp_float8_all_gather": True}}


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", nargs="+", choices=["ddp", "fsdp2", "fp8", "keras"], default=["ddp", "fsdp2", "fp8",
                                                                                             "keras"])
    p.add_argument("--recipes", nargs="+", default=["16-mixed", "bf16-mixed", "bf16-master"])
    p.add_argument("--comms", nargs="+", choices=COMMS, default=list(COMMS))
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--depth", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=64, help="per rank")
    p.add_argument("--json", default=None, metavar="PATH")
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)  # a worker's results (internal)
    return p.parse_args(argv)


class WireCounter:
    """A harness-style clock counting, at step ``at``, the bytes handed to every ``c10d`` op (see the module)."""

    def __init__(self, at: int, total: int) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        self.at, self.total, self._step = at, total, 0
        self.by_op: dict[str, dict[str, int]] = {}
        counter = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
                if func.namespace in ("c10d", "_c10d_functional"):
                    counter.record(func.overloadpacket.__name__, args)
                return func(*args, **(kwargs or {}))

        self._mode = Mode()

    def record(self, name: str, args: Any) -> None:
        import torch

        handed = args[1] if "reduce_scatter" in name else args[0]
        flat = handed if isinstance(handed, (list, tuple)) else [handed]
        flat = [t for x in flat for t in (x if isinstance(x, (list, tuple)) else [x]) if isinstance(t, torch.Tensor)]
        op = "all_gather" if "gather" in name else "reduce_scatter" if "reduce_scatter" in name else \
            "all_reduce" if "allreduce" in name or "all_reduce" in name else name
        per = self.by_op.setdefault(op, {})
        for t in flat:
            dtype = str(t.dtype).replace("torch.", "")
            per[dtype] = per.get(dtype, 0) + t.numel() * t.element_size()

    def begin(self) -> None:
        if self._step == self.at:
            self._mode.__enter__()

    def end(self) -> None:
        if self._step == self.at:
            self._mode.__exit__(None, None, None)
        self._step += 1


def lightning_run(strategy: str, side: str, recipe: str, comm: str, fp8: dict | None, args: Any, data: Any) -> dict:
    """One 2-rank fit; returns the bytes counted at step 2, the per-step mean losses, the skips."""
    import lightning.pytorch as pl
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    import torch_models as tm
    from harness import Variant
    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy
    from lightning_variants import StepHooks, trainer_plugin
    from torch.utils.data import DataLoader

    from lightning_ext import fully_shard_model
    from mp_callbacks import get_recipe

    options = {} if side == "native" else {"comm_dtype": comm, **({"fp8": fp8} if fp8 else {})}
    chosen = get_recipe(recipe, **options) if side == "ours" else None

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = tm.mlp(args.hidden, args.depth)
            self.losses: list[torch.Tensor] = []

        def configure_model(self) -> None:
            if strategy == "fsdp2" and not hasattr(self.net, "_get_fsdp_state"):
                fully_shard_model(self.net, chosen, self.device_mesh["data_parallel"], units=["Linear"])

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            loss = F.cross_entropy(self.net(batch[0]).float(), batch[1])
            self.losses.append(loss.detach().float())
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    batches = [(x[rank::world], y[rank::world]) for x, y in data]  # each rank its half of the global batch
    counter = WireCounter(2, args.steps)
    plugin = trainer_plugin(Variant(side, recipe), "cpu", options)
    chosen_strategy = DDPStrategy() if strategy == "ddp" else ModelParallelStrategy(data_parallel_size=world,
                                                                                    tensor_parallel_size=1)
    module = Module()
    trainer = pl.Trainer(accelerator="cpu", devices=world, strategy=chosen_strategy, plugins=[plugin],
                         max_steps=args.steps, callbacks=[StepHooks(counter)], use_distributed_sampler=False,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    trainer.fit(module, DataLoader(batches, batch_size=None))
    losses = torch.stack(module.losses)
    dist.all_reduce(losses)
    scaler = getattr(trainer, "scaler", None) or getattr(plugin, "scaler", None)
    return {"bytes": counter.by_op, "losses": (losses / world).tolist(),
            "skipped": getattr(scaler, "skipped", None), "steps": trainer.global_step}


def lightning_worker(argv: list[str]) -> None:
    import harness

    harness.quiet()
    import torch
    import torch_models as tm

    torch.set_num_threads(1)
    args = parse(argv)
    global_batches, _ = tm.digits(args.steps, 2 * args.batch_size)
    runs: list[tuple[str, str, str, str, str, dict | None]] = []  # part, side, recipe, comm, label, fp8
    for part in ("ddp", "fsdp2"):
        if part in args.parts:
            runs += [(part, "ours", r, c, f"ours {r}", None) for r in args.recipes for c in args.comms]
        if part == "ddp" and part in args.parts:
            runs.append(("ddp", "native", "bf16-mixed", "float32", "native bf16-mixed", None))
    if "fp8" in args.parts:
        runs += [("fsdp2 fp8", "ours", "fp8-mixed", "float32", name, fp8) for name, fp8 in FP8_RUNS.items()]
        runs.append(("fsdp2 fp8", "ours", "bf16-master", "float32", "bf16-master", None))
    strategy_of = {"ddp": "ddp", "fsdp2": "fsdp2", "fsdp2 fp8": "fsdp2"}
    results = []
    for part, side, recipe, comm, label, fp8 in runs:
        r = lightning_run(strategy_of[part], side, recipe, comm, fp8, args, global_batches)
        results.append({"part": part, "run": label, "recipe": recipe, "comm_dtype": comm, **r})
    if int(os.environ["RANK"]) == 0:
        with open(args.out, "w") as fh:
            json.dump(results, fh)


def launch_lightning(argv: list[str], out: str) -> None:
    with socket.socket() as sock:  # a free port for the rendezvous
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={port}",
           str(Path(__file__).resolve()), "--lightning-worker", *argv, "--out", out]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"the Lightning workers failed:\n{proc.stdout[-2000:]}{proc.stderr[-6000:]}")


def with_differences(results: list[dict]) -> list[dict]:
    """Each run's largest per-step loss difference from its reference: the float32-communication run of the same
    part and recipe (FP8 runs: the current-scaling bf16 gather; native: ours float32)."""
    by_key = {(r["part"], r["run"], r["comm_dtype"]): r for r in results}
    for r in results:
        ref = by_key.get((r["part"], r["run"], "float32"))
        if r["part"] == "fsdp2 fp8":
            ref = by_key.get((r["part"], "fp8-mixed current, bf16 gather", "float32"))
        elif r["run"].startswith("native"):
            ref = by_key.get((r["part"], "ours bf16-mixed", "float32"))
        r["reference"] = None if ref is None or ref is r else f"{ref['run']}, {ref['comm_dtype']}"
        diffs = [abs(a - b) for a, b in zip(r["losses"], ref["losses"])] if r["reference"] else []
        r["max_loss_diff"] = max(diffs) if diffs else None
        r["final_loss"] = r["losses"][-1] if r["losses"] else None
    return results


def _bytes(per: dict[str, int]) -> str:
    short = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
    return " + ".join(f"{b:,} {short.get(d, d)}" for d, b in sorted(per.items())) or "-"


def markdown(results: list[dict]) -> str:
    lines = ["| part | run | comm_dtype | all-reduce / step | all-gather / step | reduce-scatter / step | skipped | "
             "last loss | max per-step loss difference (vs) |", "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        if r.get("note"):
            lines.append(f"| {r['part']} | {r['run']} | {r['comm_dtype']} | {r['note']} | | | | | |")
            continue
        b = r["bytes"]
        diff = "-" if r["max_loss_diff"] is None else f"{r['max_loss_diff']:.5f} ({r['reference']})"
        final = "-" if r["final_loss"] is None else f"{r['final_loss']:.5f}"
        lines.append(f"| {r['part']} | {r['run']} | {r['comm_dtype']} | {_bytes(b.get('all_reduce', {}))} | "
                     f"{_bytes(b.get('all_gather', {}))} | {_bytes(b.get('reduce_scatter', {}))} | "
                     f"{'-' if r['skipped'] is None else r['skipped']} | {final} | {diff} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--lightning-worker" in argv:
        lightning_worker([a for a in argv if a != "--lightning-worker"])
        return []
    args = parse(argv)
    import tempfile

    import harness

    results: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        if set(args.parts) & {"ddp", "fsdp2", "fp8"}:
            out = os.path.join(tmp, "lightning.json")
            launch_lightning(argv, out)
            with open(out) as fh:
                results += json.load(fh)
        if "keras" in args.parts:
            import scale_out_keras

            results += scale_out_keras.run(args, tmp)
    results = with_differences(results)
    print(harness.machine_line(1))
    print(f"2 processes, one thread each; MLP 64-{'-'.join([str(args.hidden)] * args.depth)}-10 on digits, batch "
          f"{args.batch_size} per rank, AdamW lr 1e-3, {args.steps} steps; bytes handed to the collectives in one "
          "step (rank 0)\n")
    print(markdown(results))
    harness.write_json(args.json, results, 1)
    return results


if __name__ == "__main__":
    main()
