"""Which recipe x optimizer-state dtype to pick: one row per combination, measured (issue #27's guidance table).

    python benchmarks/state_guidance.py [--rounds 5] [--steps 10] [--hidden 1024] [--depth 3]
                                        [--swamp-steps 3000] [--swamp-lr 1e-5]
                                        [--task-steps 200] [--task-hidden 128] [--seeds 0 1]
                                        [--frameworks lightning keras] [--only LABEL ...] [--json PATH]

Every row is a recipe label (``mp_callbacks.recipes.parse_recipe_label``: ``bf16-sr[state_dtype=bfloat16]``,
``bf16-master[master_remainders]``, ...).  Columns:

* **B/param**: model state per parameter (weights, gradients in their storage dtype, masters, AdamW's states,
  Kahan compensation) by the core's estimator (``mp_callbacks.memory.estimate_memory``) for the step-time MLP;
  ``8bit`` states are block-quantized where a tensor is large enough (``quantizes``), the biases stay FP32;
* **step / bf16-master**: the optimizer step alone (bf16 or FP32 gradients given, set before each step) through
  ``lightning_ext.FabricMixedPrecision`` on the MLP ``--depth`` x ``--hidden`` (AdamW, lr 1e-3, weight decay
  1e-2), every row alternating in one process (``common.alternate``: order reversed every other round) with a
  control (bf16-master run twice); median of the per-round ratios, min-max over rounds, CPU time (wall time in
  the JSON);
* **swamping error**: Adam (lr ``--swamp-lr``, no weight decay) on 4096 weights near 1.0 (1 + 0.01 N(0, 1), held
  exactly in bf16) pulled towards targets 0.1 N(0, 1) away, ``--swamp-steps`` steps: every update (~lr) is far
  below half a bf16 ulp of its weight (2**-9 just under 1.0).  The gradient is ``w - target`` from the weight
  the forward uses (the stored one).  The figure: ``|w - w_fp32| / |w_fp32 - w_0|`` of the final stored
  weights against the 32-true run's; the 32-true run rounded to bf16 is the floor any bf16-stored weight sees
  (printed as its own row, ``32-true rounded to bf16``);
* **accuracy - 32-true**: the built-in task (``mpx compare``'s MLP on scikit-learn's digits,
  ``mp_callbacks.app.lightning_runner.run`` / ``keras_runner.run``: same initial weights and batches) per
  framework, test accuracy in points minus 32-true's, mean over ``--seeds``; 360 test images, one image is
  0.28 points.

Prints the CPU model and the load.  No thresholds: figures only.
"""

from __future__ import annotations

import logging
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import alternate, by_clock, machine_line, per_step, summary, with_controls, write_json  # noqa: E402

from mp_callbacks.memory import estimate_memory  # noqa: E402
from mp_callbacks.recipes import get_recipe, recipe_label  # noqa: E402

LABELS = (
    "32-true", "bf16-mixed",
    "bf16-master", "bf16-master[master_remainders]", "bf16-master[state_dtype=8bit]",
    "bf16-master[state_dtype=8bit,master_remainders]",
    "bf16-kahan", "bf16-kahan[state_dtype=bfloat16]", "bf16-kahan[state_dtype=8bit]",
    "bf16-sr", "bf16-sr[state_dtype=bfloat16]", "bf16-sr[state_dtype=8bit]",
)
"""Every recipe x state dtype the five recipes accept (``mp_callbacks.weights.masters.check_state_dtype``'s rules)."""

BASELINE = "bf16-master"
REFERENCE = "32-true"
ROUNDED = "32-true rounded to bf16"
SWAMP_SHAPE = (4, 1024)  # 4096 weights: the least an 8-bit state quantizes (quantized_states.MIN_NUMEL)


@dataclass
class Row:
    """One recipe label's figures (None: not measured)."""

    label: str
    bytes_per_param: float | None = None
    step_ratio: dict[str, float] | None = None  # CPU time: median, min, max
    swamp_error: float | None = None
    accuracy_delta: dict[str, float] = field(default_factory=dict)  # framework -> points vs 32-true
    accuracy: dict[str, float] = field(default_factory=dict)  # framework -> mean test accuracy

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def state_dtype_name(label: str) -> str:
    """The row's state dtype as the table shows it (``float32``, ``bfloat16``, ``8bit``)."""
    return get_recipe(label).master.state_dtype


def plugin(label: str) -> Any:
    """``lightning_ext.FabricMixedPrecision`` for the label's recipe, state dtype and masters."""
    from lightning_ext import FabricMixedPrecision

    recipe = get_recipe(label)
    return FabricMixedPrecision(recipe.name, state_dtype=recipe.master.state_dtype,
                                master_remainders=recipe.master.master_remainders)


def fabric_setup(label: str, net: Any, optimizer: Callable[[Any], Any]) -> tuple[Any, Any]:
    """``(module, optimizer)`` set up by a one-device CPU Fabric under the label's plugin."""
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin(label)])
    return fabric.setup(net, optimizer(net.parameters()))


def mlp_storage(label: str, hidden: int, depth: int) -> list[tuple[int, str]]:
    """``(numel, storage dtype)`` of the step-time MLP's parameters under the label's recipe."""
    from mp_callbacks.app.lightning_runner import mlp

    dtype = get_recipe(label).master.param_dtype
    return [(p.numel(), dtype) for p in mlp(hidden, depth).parameters()]


def bytes_per_param(label: str, hidden: int, depth: int) -> float:
    """The core's estimate of the model state per parameter (AdamW) of the step-time MLP."""
    return estimate_memory(get_recipe(label).master, "adamw", mlp_storage(label, hidden, depth)).bytes_per_param


# ------------------------------------------------------------------------------------------ step time
class StepSetup:
    """One label's MLP, AdamW through the plugin, and fixed gradients in the parameters' dtypes."""

    def __init__(self, label: str, hidden: int, depth: int) -> None:
        import torch

        from mp_callbacks.app.lightning_runner import mlp

        torch.manual_seed(0)
        self.model, self.opt = fabric_setup(label, mlp(hidden, depth),
                                            lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=1e-2))
        self.params = list(self.model.parameters())
        gen = torch.Generator().manual_seed(1)
        self.grads = [(torch.randn(p.shape, generator=gen) * 1e-2).to(p.dtype) for p in self.params]

    def step(self) -> None:
        for p, g in zip(self.params, self.grads):
            p.grad = g
        self.opt.step()
        self.opt.zero_grad()


def step_ratios(labels: Sequence[str], hidden: int, depth: int, rounds: int, steps: int,
                threads: int = 1) -> dict[str, Any]:
    """Optimizer step time of every label against ``bf16-master``'s (and its control), alternating in one
    process: ``{"ratios": {label: {clock: {median, min, max}}}, "control": ..., "summary": ...}``."""
    import torch

    torch.set_num_threads(threads)
    variants = {}
    for label in dict.fromkeys([BASELINE, *labels]):
        setup = StepSetup(label, hidden, depth)
        for _ in range(2):  # warm-up: the states are created, torchao's 8-bit step compiled
            setup.step()
        variants[label] = per_step(setup.step, steps)
    times = alternate(with_controls(variants, [BASELINE]), rounds)
    out: dict[str, Any] = {"ratios": {}, "clocks": {}}
    for clock, per_clock in by_clock(times).items():
        data = summary(per_clock, [(label, BASELINE, "-") for label in variants])
        out["clocks"][clock] = data
        for row in data["ratios"]:
            out["ratios"].setdefault(row["ours"], {})[clock] = {k: row[k] for k in ("median", "min", "max")}
        control = data["ratios"][0]["control"]
        out.setdefault("control", {})[clock] = control
    return out


def grouped_step_ratios(labels: Sequence[str], hidden: int, depth: int, rounds: int, steps: int,
                        threads: int = 1) -> dict[str, Any]:
    """:func:`step_ratios` for the eager labels together, then for the 8-bit ones (torchao's compiled step)
    together, each group against its own ``bf16-master`` and control: measured in one group, torchao's
    compiled 8-bit steps slowed the eager steps timed beside them (``bf16-kahan`` 0.54-0.65x ``bf16-master``
    alone, 1.47-1.55x with them; 2026-12-03).  ``control`` is the first group's; ``controls`` all of them."""
    groups = [[label for label in labels if ("8bit" in label) is compiled] for compiled in (False, True)]
    out: dict[str, Any] = {"ratios": {}, "controls": []}
    for group in groups:
        if not group:
            continue
        part = step_ratios(group, hidden, depth, rounds, steps, threads)
        out["ratios"].update(part["ratios"])
        out["controls"].append(part["control"])
        out.setdefault("control", part["control"])
        out.setdefault("clocks", part["clocks"])
    return out


# ------------------------------------------------------------------------------------------ swamping
def swamp_weights(label: str, steps: int, lr: float) -> tuple[Any, Any]:
    """``(w_0, final stored weights)`` (FP32 copies) of the swamping run under ``label``."""
    import torch
    from torch import nn

    gen = torch.Generator().manual_seed(0)
    w0 = (1.0 + 0.01 * torch.randn(SWAMP_SHAPE, generator=gen)).to(torch.bfloat16).float()
    target = w0 + 0.1 * torch.randn(SWAMP_SHAPE, generator=gen)
    net = nn.Linear(SWAMP_SHAPE[1], SWAMP_SHAPE[0], bias=False)
    with torch.no_grad():
        net.weight.copy_(w0)
    model, opt = fabric_setup(label, net, lambda ps: torch.optim.AdamW(ps, lr=lr, weight_decay=0.0))
    (w,) = list(model.parameters())
    for _ in range(steps):
        w.grad = (w.detach().float() - target).to(w.dtype)
        opt.step()
        opt.zero_grad()
    return w0, w.detach().float().clone()


def swamp_errors(labels: Sequence[str], steps: int, lr: float) -> dict[str, float]:
    """``|w - w_fp32| / |w_fp32 - w_0|`` per label, and :data:`ROUNDED` (the 32-true run rounded to bf16)."""
    import torch

    w0, ref = swamp_weights(REFERENCE, steps, lr)
    moved = float(torch.linalg.vector_norm(ref - w0))

    def error(w: Any) -> float:
        return float(torch.linalg.vector_norm(w - ref)) / moved

    out = {ROUNDED: error(ref.to(torch.bfloat16).float())}
    for label in labels:
        out[label] = 0.0 if label == REFERENCE else error(swamp_weights(label, steps, lr)[1])
    return out


# ------------------------------------------------------------------------------------------ built-in task
def task_accuracy(framework: str, labels: Sequence[str], spec: Any, seeds: Sequence[int]) -> dict[str, float]:
    """Mean test accuracy over ``seeds`` of the built-in task per label (32-true always included)."""
    import dataclasses
    import importlib

    from mp_callbacks.app.compare import FRAMEWORKS

    runner = importlib.import_module(FRAMEWORKS[framework])
    out = {}
    for label in dict.fromkeys([REFERENCE, *labels]):
        accs = []
        for seed in seeds:
            result = runner.run(label, dataclasses.replace(spec, seed=seed))
            if result.error is not None:
                raise RuntimeError(f"{framework} {label}: {result.error}")
            accs.append(result.accuracy)
        out[label] = statistics.fmean(accs)
    return out


# ------------------------------------------------------------------------------------------ the table
def guidance_rows(labels: Sequence[str], *, hidden: int, depth: int, rounds: int, steps: int, swamp_steps: int,
                  swamp_lr: float, task_spec: Any, seeds: Sequence[int], frameworks: Sequence[str],
                  parts: Sequence[str] = ("bytes", "step", "swamp", "task")) -> tuple[list[Row], dict[str, Any]]:
    """Measure the ``parts`` for every label; returns the rows and the raw figures (controls, JSON)."""
    labels = [recipe_label(label) for label in labels]
    rows = {label: Row(label) for label in labels}
    raw: dict[str, Any] = {}
    if "bytes" in parts:
        for label in labels:
            rows[label].bytes_per_param = bytes_per_param(label, hidden, depth)
    if "step" in parts:
        raw["step"] = grouped_step_ratios(labels, hidden, depth, rounds, steps)
        for label in labels:
            rows[label].step_ratio = raw["step"]["ratios"][label]["cpu"]
    if "swamp" in parts:
        raw["swamp"] = swamp_errors(labels, swamp_steps, swamp_lr)
        for label in labels:
            rows[label].swamp_error = raw["swamp"][label]
    if "task" in parts:
        for framework in frameworks:
            accs = task_accuracy(framework, labels, task_spec, seeds)
            raw.setdefault("task", {})[framework] = accs
            for label in labels:
                rows[label].accuracy[framework] = accs[label]
                rows[label].accuracy_delta[framework] = 100 * (accs[label] - accs[REFERENCE])
    return list(rows.values()), raw


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def markdown_table(rows: Sequence[Row], raw: dict[str, Any], frameworks: Sequence[str]) -> str:
    """The guidance table (one line per row) with the control and the bf16-rounding floor under it."""
    head = ["recipe", "state dtype", "B/param", "optimizer step / bf16-master (CPU time)", "swamping error"]
    head += [f"accuracy - 32-true, {fw} (points)" for fw in frameworks]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        name = get_recipe(row.label).name + (" (master_remainders)" if get_recipe(row.label).master.master_remainders
                                             else "")
        step = row.step_ratio
        cells = [f"`{name}`", state_dtype_name(row.label), _fmt(row.bytes_per_param, ".2f"),
                 "-" if step is None else f"{step['median']:.2f} ({step['min']:.2f}-{step['max']:.2f})",
                 _fmt(row.swamp_error, ".3f")]
        cells += [_fmt(row.accuracy_delta.get(fw), "+.2f") for fw in frameworks]
        lines.append("| " + " | ".join(cells) + " |")
    notes = []
    if "step" in raw:
        for i, control in enumerate(raw["step"].get("controls", [raw["step"]["control"]])):
            c = control["cpu"]
            group = "" if len(raw["step"].get("controls", ())) < 2 else (" (eager group)", " (8-bit group)")[i]
            notes.append(f"control{group} (bf16-master / bf16-master): {c['median']:.2f} "
                         f"({c['min']:.2f}-{c['max']:.2f})")
    if "swamp" in raw:
        notes.append(f"swamping floor ({ROUNDED}): {raw['swamp'][ROUNDED]:.3f}")
    if "task" in raw:
        notes.append("32-true accuracy: " + ", ".join(f"{fw} {100 * raw['task'][fw][REFERENCE]:.2f}%"
                                                      for fw in raw["task"]))
    return "\n".join(lines + ([""] + [f"{n}." for n in notes] if notes else []))


def load_line() -> str:
    """``uptime``'s load averages (empty where /proc/loadavg is missing)."""
    try:
        return "load average " + " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return ""


def main(argv: Sequence[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps per timed measurement")
    parser.add_argument("--hidden", type=int, default=1024, help="step-time MLP width")
    parser.add_argument("--depth", type=int, default=3, help="step-time MLP hidden layers")
    parser.add_argument("--swamp-steps", type=int, default=3000)
    parser.add_argument("--swamp-lr", type=float, default=1e-5)
    parser.add_argument("--task-steps", type=int, default=200)
    parser.add_argument("--task-hidden", type=int, default=128)
    parser.add_argument("--task-depth", type=int, default=2)
    parser.add_argument("--task-batch-size", type=int, default=64)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--frameworks", nargs="+", choices=["lightning", "keras"], default=["lightning", "keras"])
    parser.add_argument("--parts", nargs="+", choices=["bytes", "step", "swamp", "task"],
                        default=["bytes", "step", "swamp", "task"])
    parser.add_argument("--only", nargs="+", default=None, metavar="LABEL", help="these labels only")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", default=None, metavar="PATH")
    args = parser.parse_args(argv)
    from mp_callbacks.app.compare import RunSpec

    logging.getLogger("lightning").setLevel(logging.ERROR)
    logging.getLogger("lightning.fabric").setLevel(logging.ERROR)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    print(machine_line(args.threads))
    print(f"start: {load_line()}")
    spec = RunSpec(steps=args.task_steps, batch_size=args.task_batch_size, hidden=args.task_hidden,
                   depth=args.task_depth, threads=args.threads)
    t0 = time.perf_counter()
    rows, raw = guidance_rows(args.only or LABELS, hidden=args.hidden, depth=args.depth, rounds=args.rounds,
                              steps=args.steps, swamp_steps=args.swamp_steps, swamp_lr=args.swamp_lr, task_spec=spec,
                              seeds=args.seeds, frameworks=args.frameworks, parts=args.parts)
    print(f"\nMLP {args.depth}x{args.hidden} (B/param, step time); swamping: Adam lr {args.swamp_lr}, "
          f"{args.swamp_steps} steps; built-in task: {spec.setup_line()} seeds {args.seeds}\n")
    print(markdown_table(rows, raw, args.frameworks if "task" in args.parts else []))
    print(f"\nend: {load_line()}; {time.perf_counter() - t0:.0f} s")
    write_json(args.json, {"rows": [r.to_dict() for r in rows], "raw": raw, "args": vars(args)})


if __name__ == "__main__":
    main()
