"""Kernel launches and host syncs of one training step, ours vs native, per recipe (counted, not timed).

    python benchmarks/launches.py [--frameworks trainer fabric keras] [--models tiny hf] [--recipes ...]
        [--optimizers foreach fused] [--d-model 128] [--layers 2] [--seq 32] [--batch-size 4] [--warmup 3]
        [--device cpu|cuda] [--json PATH]

What decides a GPU step's overhead can be counted without a GPU: every aten op that reaches the dispatcher is a
kernel launch on CUDA (views and allocations excepted: counted as ops, not as kernels), and a scalar read of a
device tensor (``aten._local_scalar_dense``: ``.item()``, ``bool(t)``, ``float(t)``) stalls the host until the
device has caught up (a *sync*).  For ONE training step after ``--warmup`` steps, a
``torch.utils._python_dispatch.TorchDispatchMode`` counts every op by name (it sees the ops below autograd, the
backward's included: what launches).  Scalar reads of the optimizer's ``step`` tensors are left out (torch keeps
them on the host unless the optimizer is fused or capturable; they are found through torch's global
``register_optimizer_step_pre_hook``).  The step is the one a user runs:

* ``trainer``: ``Trainer(plugins=[...])``, from ``on_train_batch_start`` to ``on_train_batch_end`` (training step,
  backward, optimizer step); ``fabric``: ``fabric.backward(loss)``, ``opt.step()``, ``opt.zero_grad()``; ours
  ``lightning_ext.MixedPrecision`` / ``FabricMixedPrecision``, native Lightning's own plugin (``GradScaler`` under
  ``16-mixed``), with the user's ``AdamW(foreach=True)`` (as on CUDA) and ``AdamW(fused=True)``;
* ``keras``: ``model.fit`` on the torch backend (a subprocess with ``KERAS_BACKEND=torch``), from
  ``on_train_batch_begin`` to ``on_train_batch_end``; ours ``keras_ext`` (``set_global_policy``, ``apply_policy``,
  ``master_optimizer``), native Keras' own policies and ``LossScaleOptimizer``; Keras' AdamW (one row per recipe).

Recipes native lacks are compared with ``harness.native_of``'s.  Printed per row: ops, kernels and syncs ours /
native, and the op names whose counts differ (``name ours-native``).  On CUDA (``--device cuda``) the syncs are also
counted by torch itself (``torch.cuda.set_sync_debug_mode("warn")``: one warning per synchronizing call).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import RECIPES, Variant, machine_line, quiet  # noqa: E402

FRAMEWORKS = ("trainer", "fabric", "keras")
NOT_KERNELS = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "_local_scalar_dense",
               "set_", "lift_fresh", "resize_", "record_stream"}
"""Ops that launch no kernel (allocations, metadata); views (``OpOverload.is_view``) launch none either."""


class StepCounter:
    """A harness-style clock (``begin``/``end``/``total``) that counts the ops of step ``warmup`` (0-based)."""

    def __init__(self, warmup: int, device: str = "cpu") -> None:
        import torch
        from torch.utils._python_dispatch import TorchDispatchMode

        self.total, self.device = warmup + 1, device
        self._step = 0
        self.ops: collections.Counter[str] = collections.Counter()
        self.kernels = self.syncs = self.step_reads = 0
        self.cuda_syncs: int | None = None
        self._step_tensors: set[int] = set()
        counter = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
                name = func.overloadpacket.__name__
                if func.namespace == "profiler":  # record_function's markers (the optimizer step's): no work
                    return func(*args, **(kwargs or {}))
                if name == "_local_scalar_dense":
                    if args[0].untyped_storage().data_ptr() in counter._step_tensors:
                        counter.step_reads += 1  # a host tensor: no sync, no launch
                        return func(*args, **(kwargs or {}))
                    counter.syncs += 1
                ns = func.namespace
                counter.ops[name if ns == "aten" else f"{ns}.{name}"] += 1
                if not func.is_view and name not in NOT_KERNELS:
                    counter.kernels += 1
                return func(*args, **(kwargs or {}))

        def collect(optimizer: Any, args: Any, kwargs: Any) -> None:
            for state in optimizer.state.values():
                step = state.get("step") if isinstance(state, dict) else None
                if isinstance(step, torch.Tensor):
                    self._step_tensors.add(step.untyped_storage().data_ptr())

        self._mode = Mode()
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        self._hook_register = register_optimizer_step_pre_hook
        self._collect = collect
        self._hook: Any = None
        self._warn: Any = None

    def begin(self) -> None:
        if self._step != self.total - 1:
            return
        self._hook = self._hook_register(self._collect)
        if self.device == "cuda":
            import torch

            torch.cuda.synchronize()
            self._warn = warnings.catch_warnings(record=True)
            self._caught = self._warn.__enter__()
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
        self._mode.__enter__()

    def end(self) -> None:
        if self._step == self.total - 1:
            self._mode.__exit__(None, None, None)
            self._hook.remove()
            if self._warn is not None:
                import torch

                torch.cuda.set_sync_debug_mode("default")
                self.cuda_syncs = sum("synchroniz" in str(w.message) for w in self._caught)
                self._warn.__exit__(None, None, None)
        self._step += 1

    def result(self) -> dict[str, Any]:
        out = {"ops": sum(self.ops.values()), "kernels": self.kernels, "syncs": self.syncs,
               "optimizer_step_reads": self.step_reads, "by_op": dict(sorted(self.ops.items()))}
        if self.cuda_syncs is not None:
            out["cuda_syncs"] = self.cuda_syncs
        return out


def count_lightning(framework: str, v: Variant, model: str, sizes: argparse.Namespace, device: str) -> dict:
    """One Lightning variant's counts (its model, optimizer and loop built here, trained warmup + 1 steps)."""
    import lightning_variants as lv
    import torch_models as tm

    cfg = tm.GPTConfig.sized(sizes.d_model, sizes.layers, sizes.seq, sizes.vocab)
    batches = tm.token_batches(cfg, 4, sizes.batch_size)
    counter = StepCounter(sizes.warmup, device)
    lv.BUILDERS[framework](v, lambda: tm.build(model, cfg), batches, tm.lm_loss, device)(counter)()
    return counter.result()


def count_keras(v: Variant, model: str, sizes: argparse.Namespace) -> dict:
    import keras_variants as kv

    counter = StepCounter(sizes.warmup)
    kv.fit_build(v, model, sizes.vocab, sizes.seq, sizes.d_model, sizes.layers, sizes.batch_size)(counter)()
    return counter.result()


def rows(framework: str, model: str, optimizer: str, recipes: list[str], sizes: argparse.Namespace,
         device: str) -> list[dict]:
    """Ours and native counted per recipe (each native once)."""
    natives: dict[str, dict] = {}
    out = []
    for recipe in recipes:
        ours = Variant("ours", recipe, optimizer)
        ref = ours.reference()
        for v in (ref, ours):
            if v.name in natives and v.side == "native":
                continue
            counted = (count_keras(v, model, sizes) if framework == "keras"
                       else count_lightning(framework, v, model, sizes, device))
            if v.side == "native":
                natives[v.name] = counted
            else:
                mine = counted
        theirs = natives[ref.name]
        names = set(mine["by_op"]) | set(theirs["by_op"])
        differ = {n: [mine["by_op"].get(n, 0), theirs["by_op"].get(n, 0)] for n in sorted(names)
                  if mine["by_op"].get(n, 0) != theirs["by_op"].get(n, 0)}
        out.append({"framework": framework, "model": model, "optimizer": optimizer, "recipe": recipe,
                    "ours": ours.name, "native": ref.name, "ours_counts": mine, "native_counts": theirs,
                    "differ": differ})
    return out


def markdown(results: list[dict]) -> str:
    lines = ["| framework | model | optimizer | ours | native | ops ours/native | kernels ours/native | "
             "syncs ours/native | ops that differ (ours-native) |", "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        a, b = r["ours_counts"], r["native_counts"]
        syncs = f"{a['syncs']}/{b['syncs']}"
        if "cuda_syncs" in a:
            syncs += f" (CUDA: {a['cuda_syncs']}/{b['cuda_syncs']})"
        differ = ", ".join(f"{n} {x}-{y}" for n, (x, y) in r["differ"].items()) or "none"
        lines.append(f"| {r['framework']} | {r['model']} | {r['optimizer']} | {r['ours']} | {r['native']} | "
                     f"{a['ops']}/{b['ops']} ({a['ops'] / max(b['ops'], 1):.2f}) | "
                     f"{a['kernels']}/{b['kernels']} ({a['kernels'] / max(b['kernels'], 1):.2f}) | {syncs} | "
                     f"{differ} |")
    return "\n".join(lines)


def keras_subprocess(args: argparse.Namespace) -> list[dict]:
    """The Keras rows, counted in a subprocess on the torch backend."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "keras.json")
        cmd = [sys.executable, __file__, "--keras-worker", out, "--models", *args.models, "--recipes", *args.recipes,
               *sizes_argv(args)]
        env = dict(os.environ, KERAS_BACKEND="torch", TF_CPP_MIN_LOG_LEVEL="2")
        proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
        if proc.returncode:
            raise RuntimeError(f"the Keras worker failed:\n{proc.stdout[-2000:]}{proc.stderr[-4000:]}")
        with open(out) as fh:
            return json.load(fh)


def sizes_argv(args: argparse.Namespace) -> list[str]:
    return [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in ("d_model", "layers", "seq", "vocab",
                                                                     "batch_size", "warmup")]


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--frameworks", nargs="+", choices=FRAMEWORKS, default=list(FRAMEWORKS))
    p.add_argument("--models", nargs="+", choices=["tiny", "hf"], default=["tiny", "hf"])
    p.add_argument("--recipes", nargs="+", choices=RECIPES, default=list(RECIPES))
    p.add_argument("--optimizers", nargs="+", choices=["default", "foreach", "fused"], default=["foreach", "fused"],
                   help="the user's torch AdamW (Lightning); Keras runs its AdamW once")
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--warmup", type=int, default=3, help="steps before the counted one")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="Lightning's device (Keras: CPU)")
    p.add_argument("--json", default=None, metavar="PATH")
    p.add_argument("--keras-worker", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> list[dict]:
    """Count, print the table (and write ``--json``); returns the rows."""
    args = parse(argv)
    quiet()
    import torch

    torch.set_num_threads(1)
    if args.keras_worker:
        results = [r for m in args.models for r in rows("keras", m, "default", args.recipes, args, "cpu")]
        with open(args.keras_worker, "w") as fh:
            json.dump(results, fh)
        return results
    results = []
    for framework in args.frameworks:
        if framework == "keras":
            results += keras_subprocess(args)
            continue
        for model in args.models:
            for optimizer in args.optimizers:
                results += rows(framework, model, optimizer, args.recipes, args, args.device)
    print(machine_line(1))
    print(f"One training step after {args.warmup} warm-up steps: transformer d_model {args.d_model}, {args.layers} "
          f"layers, seq {args.seq}, vocab {args.vocab}, batch {args.batch_size}; Lightning on {args.device}, Keras on "
          "the torch backend (CPU)\n")
    print(markdown(results))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"machine": machine_line(1), "device": args.device, "rows": results}, fh, indent=2)
        print(f"\ncounts written to {args.json}")
    return results


if __name__ == "__main__":
    main()
