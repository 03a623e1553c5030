"""What each piece of a Lightning step costs in place: exclusive time per call site, ours beside native.

    python benchmarks/step_pieces.py [--model hf|tiny] [--steps 150] [--rounds 2]
        [--variants "native 32-true" "ours 32-true" ...]

bench_transformer.py's ratios say how much slower a whole step is; this says where, in the step
as the Trainer runs it (caches as cold as they are there, which tight loops of the same calls
are not).  Every variant trains bench_transformer.py's model through the ``Trainer``; the
functions named in :data:`PIECES` are wrapped with ``time.perf_counter_ns`` (~0.1 us a call) and
each one's time *excluding* the wrapped functions it calls is summed per step; the figure is the
median over the steps after the first 20, fits of the variants alternating (``--rounds`` each).
The forward and backward show up in ``Closure`` and ``Precision.backward``; torch's AdamW in
``AdamW.step`` (its loop over the parameters) and ``adam math`` (the update); what only ours runs
is every row where native shows 0 (``scaler.step`` includes torch's ``Optimizer.step`` wrapper, its
profiling and hook calls, which native runs inside its own ``optimizer_step``).  Read the rows as
attribution; take ratios from bench_transformer.py.
"""

from __future__ import annotations

import collections
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_transformer as bt  # noqa: E402
import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
import torch.optim.adam as torch_adam  # noqa: E402
from bench_transformer_model import GPTConfig, token_batches  # noqa: E402
from common import machine_line  # noqa: E402
from lightning.pytorch.loops.optimization.automatic import Closure  # noqa: E402

import lightning_ext.divergence as divergence  # noqa: E402
import lightning_ext.master_native as master_native  # noqa: E402
import lightning_ext.plugin as plugin  # noqa: E402
import lightning_ext.scaler as scaler  # noqa: E402

PIECES: list[tuple[Any, str, str]] = [  # (owner, attribute, label)
    (Closure, "__call__", "Closure (forward, hooks)"),
    (torch_adam, "_single_tensor_adam", "adam math (loop)"),
    (torch_adam, "_fused_adam", "adam math (fused)"),
    (torch.optim.AdamW, "step", "AdamW.step"),
    (torch, "_amp_foreach_non_finite_check_and_unscale_", "check kernel"),
    (master_native.NativeAdam, "scan", "check scan (native, read only)"),
    (scaler, "non_finite_check", "non_finite_check"),
    (plugin.MixedPrecision, "clip_gradients", "lightning_ext:MixedPrecision.clip_gradients"),
    *[(scaler.TorchLossScaler, m, f"scaler.{m}") for m in
      ("unscale_once", "step", "update", "skips", "scale", "to", "_host_transition", "last_step_skipped")],
    (divergence.TorchDivergence, "record_loss", "divergence.record_loss"),
    (divergence.TorchDivergence, "applied", "divergence.applied"),
]
METHODS = ("optimizer_step", "backward", "post_backward", "pre_backward", "_after_closure", "_after_step",
           "forward_context", "autocast_context_manager")  # found on the plugins' classes (ours and native)


class Pieces:
    """Exclusive nanoseconds per label in the current step."""

    def __init__(self) -> None:
        self.now: collections.defaultdict[str, int] = collections.defaultdict(int)
        self._stack: list[int] = []

    def wrap(self, owner: Any, attr: str, label: str) -> None:
        if not hasattr(owner, attr):
            return
        fn, stack, now, clock = getattr(owner, attr), self._stack, self.now, time.perf_counter_ns

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = clock()
            stack.append(0)
            try:
                return fn(*args, **kwargs)
            finally:
                spent = clock() - t0
                now[label] += spent - stack.pop()
                if stack:
                    stack[-1] += spent
        setattr(owner, attr, timed)


def install(pieces: Pieces) -> None:
    """Wrap :data:`PIECES` and, on ours' and native's plugin classes, the class that defines each of METHODS."""
    from lightning.pytorch.plugins.precision import MixedPrecision as NativeMixed

    for owner, attr, label in PIECES:
        pieces.wrap(owner, attr, label)
    done: set[tuple[type, str]] = set()
    for cls in (plugin.MixedPrecision, NativeMixed):
        for name in METHODS:
            owner = next((c for c in cls.__mro__ if name in c.__dict__), None)
            if owner is not None and (owner, name) not in done:
                done.add((owner, name))
                pieces.wrap(owner, name, f"{owner.__module__.split('.')[0]}:{owner.__name__}.{name}")


def main() -> None:
    import argparse
    import logging
    import warnings

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(bt.MODELS), default="hf")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--variants", nargs="+", default=["native 32-true", "ours 32-true", "native bf16-mixed",
                                                            "ours bf16-mixed"], choices=sorted(bt.VARIANTS))
    args = parser.parse_args()
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    print(machine_line(1))
    cfg = GPTConfig(vocab=512, seq=32, d_model=128, heads=4, layers=2, ff=512)
    batches = token_batches(cfg, args.steps, 4)
    pieces = Pieces()
    install(pieces)
    rows: dict[str, collections.defaultdict[str, list[float]]] = {
        v: collections.defaultdict(list) for v in args.variants}
    current: list[str] = []

    class PerStep(pl.Callback):
        def on_train_batch_start(self, *a: Any) -> None:
            pieces.now.clear()
            self.t0 = time.perf_counter_ns()

        def on_train_batch_end(self, trainer: pl.Trainer, *a: Any) -> None:
            if trainer.global_step > 20:
                row = rows[current[0]]
                row["STEP (batch start to end)"].append((time.perf_counter_ns() - self.t0) / 1e3)
                for label, ns in pieces.now.items():
                    row[label].append(ns / 1e3)

    for _ in range(args.rounds):
        order = list(args.variants)
        random.shuffle(order)
        for name in order:
            current[:] = [name]
            make, fused = bt.VARIANTS[name]
            module = bt.LM(cfg, 0, fused, args.model)
            trainer = pl.Trainer(accelerator="cpu", devices=1, plugins=[make()], max_steps=len(batches),
                                 max_epochs=1, callbacks=[PerStep()], logger=False, enable_checkpointing=False,
                                 enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
            trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(batches, batch_size=None))
    labels = sorted({k for r in rows.values() for k in r},
                    key=lambda k: -max(statistics.median(r[k]) if r.get(k) else 0 for r in rows.values()))
    print(f"\n{args.model}: exclusive us per step (median over steps), {args.rounds} fit(s) of {args.steps} steps each")
    print(f"{'piece':44}" + "".join(f"{v[:22]:>24}" for v in args.variants))
    for label in labels:
        print(f"{label:44}" + "".join(f"{statistics.median(rows[v][label]) if rows[v].get(label) else 0:24.1f}"
                                      for v in args.variants))


if __name__ == "__main__":
    main()
