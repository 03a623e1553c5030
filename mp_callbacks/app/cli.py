"""Command line: ``python -m mp_callbacks`` (also installed as ``mpx``).

Subcommands:
  compare  train the same model under each recipe in Lightning and/or Keras,
           each run in a process of its own, and print/write the comparison
           (samples/s, speed-up, step time with its spread, peak memory split
           into model state and the rest, bytes/param, final loss and accuracy,
           overflows, skipped steps, a 32-true control run, the CPU's features).
  presets  the scale trajectory of every preset on one overflow pattern,
           the recipes table and the bytes/param estimate (core only).
  demo     ``make demo``: a short ``compare`` of every recipe in both
           frameworks, with one injected overflow to show recovery.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..loss_scale.config import PRESETS, ScalerConfig
from ..loss_scale.scaler import DynamicLossScaler
from ..memory.estimate import bytes_per_param
from ..recipes import RECIPE_NAMES, get_recipe

SPARK = "▁▂▃▄▅▆▇█"


def overflow_pattern(steps: int, seed: int, rate: float) -> np.ndarray:
    """A reproducible overflow pattern: random overflows plus one burst in the middle."""
    rng = np.random.default_rng(seed)
    flags = rng.random(steps) < rate
    mid = steps // 2
    flags[mid : mid + 8] = True
    return flags


def sparkline(values: Sequence[float], width: int = 48) -> str:
    """log2 of ``values`` resampled to ``width`` characters."""
    logs = np.log2(np.asarray(values, dtype=np.float64))
    idx = np.linspace(0, len(logs) - 1, num=min(width, len(logs))).astype(int)
    picked = logs[idx]
    lo, hi = float(picked.min()), float(picked.max())
    span = hi - lo or 1.0
    return "".join(SPARK[int((v - lo) / span * (len(SPARK) - 1))] for v in picked)


def presets(args: argparse.Namespace) -> int:
    flags = overflow_pattern(args.steps, args.seed, args.rate)
    print(f"Loss-scale trajectories over {args.steps} steps, {int(flags.sum())} injected overflows "
          f"(seed {args.seed}), growth_interval={args.growth_interval} for every preset:\n")
    header = (f"{'preset':<10} {'init':>8} {'final':>8} {'min':>8} {'max':>8} {'skipped':>7} {'growths':>7}  "
              "log2(scale) over time")
    print(header)
    print("-" * len(header))
    for name in PRESETS:
        config = ScalerConfig.preset(name, growth_interval=args.growth_interval, on_min_scale="clamp")
        scaler = DynamicLossScaler(config)
        scales = []
        for f in flags:
            scaler.update(bool(f))
            scales.append(scaler.scale)
        fmt = lambda v: f"2^{int(math.log2(v))}"  # noqa: E731
        print(f"{name:<10} {fmt(config.init_scale):>8} {fmt(scales[-1]):>8} {fmt(min(scales)):>8} "
              f"{fmt(max(scales)):>8} {scaler.skipped:>7} {scaler.growths:>7}  {sparkline(scales)}")
    print("\nRecipes (AdamW model-state bytes/param, activations excluded):\n")
    print(f"{'recipe':<12} {'params':<9} {'compute':<9} {'masters':<8} {'scaling':<8} {'B/param':>7}")
    for name in RECIPE_NAMES:
        r = get_recipe(name)
        print(f"{name:<12} {r.policy.params:<9} {r.policy.compute:<9} {str(r.master.master_weights):<8} "
              f"{'dynamic' if r.scaler.enabled else 'off':<8} {bytes_per_param(r.master, 'adamw'):>7.0f}")
    return 0


KERAS_TF_NOTE = (
    "Keras on TensorFlow runs every recipe with Grappler's remapper off (mp_callbacks.app.keras_runner.graph_options): "
    "its fused MatMul+BiasAdd kernel takes a slow float16 path on x86 CPUs (~100x slower "
    "than float32), while the unfused float16 ops are as fast as float32; the same setting for every recipe "
    "keeps the comparison fair and leaves float32/bfloat16 within noise."
)


def _quiet_frameworks() -> None:
    """Hide the frameworks' chatter: TF's C++ info logs (call before TF is imported) and, once
    Lightning is imported (it sets its own level on import), its per-fit info lines and tips."""
    import logging
    import os
    import warnings

    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    for name in ("lightning.pytorch", "lightning.fabric", "lightning_fabric", "pytorch_lightning"):
        logging.getLogger(name).setLevel(logging.WARNING)
    for message in (r".*does not have many workers.*", r".*GPU available but not used.*",
                    r".*isinstance\(treespec, LeafSpec\)` is deprecated.*"):
        warnings.filterwarnings("ignore", message=message)


def _load_runner(framework: str):
    from .compare import FRAMEWORKS, runner

    try:
        return runner(framework)
    except ImportError as exc:
        extra = {"lightning": "lightning", "keras": "keras"}.get(framework, "all")
        raise SystemExit(
            f"mpx compare: error: the {framework} runner ({FRAMEWORKS[framework]}) cannot be imported: {exc}; "
            f"install the extra (pip install 'mp_callbacks[{extra}]') or drop it from --frameworks"
        ) from None


def compare(args: argparse.Namespace, slowdown: dict[str, float] | None = None) -> int:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from ..recipes import canonical_recipe_name
    from .compare import RunSpec, control_ratios, format_table, write_report
    from .fp8_report import fp8_table
    from .machine import cpu_model, features, recipe_notes
    from .measurement import can_isolate, run_isolated

    try:
        recipes = list(dict.fromkeys(canonical_recipe_name(r) for r in args.recipes))
    except ValueError as exc:
        raise SystemExit(f"mpx compare: error: {exc}") from None
    if "32-true" not in recipes:
        recipes.insert(0, "32-true")  # the baseline every delta is measured against
    try:
        spec = RunSpec(steps=args.steps, batch_size=args.batch_size, hidden=args.hidden, depth=args.depth,
                       seed=args.seed, inject=tuple(args.inject), lr=args.lr, threads=args.threads,
                       skip_nonfinite=not args.no_skip_nonfinite)
    except ValueError as exc:
        raise SystemExit(f"mpx compare: error: {exc}") from None
    _quiet_frameworks()
    frameworks = list(dict.fromkeys(args.frameworks))
    runners = {framework: _load_runner(framework) for framework in frameworks}
    _quiet_frameworks()  # again: Lightning resets its logger level when it is imported
    isolate = can_isolate() and not args.in_process
    call = run_isolated if isolate else (lambda fn, *a, progress=None: fn(*a, progress))
    if slowdown is None:
        slowdown = call(_probe)  # in a child too: this process runs nothing before the runs fork
    found = features()
    machine = {"cpu": cpu_model() or "unknown CPU", "features": found, "matmul_slowdown_vs_float32": slowdown,
               "isolated_runs": isolate}
    notes = [f"CPU: {machine['cpu']}", *recipe_notes(found, slowdown)]
    print("\n".join(notes))
    plan = [(framework, recipe, False) for framework in frameworks for recipe in recipes]
    # the control: 32-true again, last in each framework's series (run-to-run noise, order independence)
    plan = [item for framework in frameworks
            for item in [p for p in plan if p[0] == framework] + [(framework, "32-true", True)]]
    results, unsupported = [], []
    with Progress(TextColumn("{task.description:<24}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), transient=True, disable=args.quiet, auto_refresh=False) as progress:
        for framework, recipe, control in plan:
            run = runners[framework]
            if not getattr(run, "supports", lambda _: True)(recipe):
                unsupported.append(f"{framework} {recipe}")
                continue
            label = f"{framework} {recipe}" + (" (control)" if control else "")
            task = progress.add_task(label, total=spec.steps)
            result = call(run, recipe, spec, progress=_throttled(progress, task))
            result.control, result.isolated = control, isolate
            results.append(result)
            progress.remove_task(task)
    print(format_table(results))
    fp8 = fp8_table(results)  # fp8-mixed runs: per-tensor FP8 rows
    if fp8:
        print("\nFP8 tensors (fp8-mixed):\n" + fp8)
    ratios = control_ratios(results)
    if ratios:
        print("control: 32-true(ctl) step time / 32-true's: " + ", ".join(f"{fw} {v:.3f}" for fw, v in ratios.items())
              + " (32-true run again, last; 1 = no run-to-run noise: every speed-up above carries this much)")
    if not isolate:
        print("note: every run shared this process (--in-process or no fork here): memory figures depend on run order")
    out = write_report(results, spec, args.out, machine=machine, notes=notes)
    if unsupported:
        note = f"not run (the adapter does not implement the recipe yet): {', '.join(unsupported)}"
        print(f"\nnote: {note}")
        with open(out / "README.md", "a") as fh:
            fh.write(f"\nNote: {note}\n")
    if "keras" in frameworks and _keras_backend() == "tensorflow":
        print(f"\nnote: {KERAS_TF_NOTE}")
        with open(out / "README.md", "a") as fh:
            fh.write(f"\nNote: {KERAS_TF_NOTE}\n")
    print(f"\nreport written to {out}/ (README.md, results.json, *.jsonl, *.png)")
    return 0


def _throttled(progress: Any, task: Any, every: float = 0.1) -> Callable[[int], None]:
    """``progress.update(task, completed=n)``, redrawn at most every ``every`` seconds (no refresh thread:
    the runs fork from this process)."""
    import time

    last = [0.0]

    def update(n: int) -> None:
        now = time.monotonic()
        draw = now - last[0] >= every
        if draw:
            last[0] = now
        progress.update(task, completed=n, refresh=draw)

    return update


def _probe(progress: Any = None) -> dict[str, float]:
    """:func:`matmul_slowdown` with the signature :func:`~mp_callbacks.app.measurement.run_isolated` calls."""
    return matmul_slowdown()


def _keras_backend() -> str:
    try:
        import keras

        return keras.backend.backend()
    except ImportError:  # pragma: no cover
        return ""


# The demo: matmuls big enough that bf16 (AMX on recent Xeons) shows a speed-up over fp32
# (~1.3-1.9x), small enough that both frameworks x every recipe (+ the 32-true controls, each
# run in a process of its own) stay under two minutes, imports included.  80 steps: each Keras
# run spends ~5 s CPU tracing its step whatever the step count, so steps are where time can go.
# One intra-op thread: with two, Lightning's OpenMP steps slow down 5-10x as soon as another job
# shares the 2 cores (the demo took 2.5 min instead of 45 s); with one it took 55 s under the same
# load.  One injected overflow shows skip and recovery.
DEMO_ARGS = ("--steps", "80", "--hidden", "1024", "--batch-size", "256", "--depth", "2", "--inject", "40",
             "--threads", "1")


# On CPUs without a fast float16/bfloat16 matmul kernel (seen: an AMD EPYC where torch's float16
# matmul ran ~25x slower than float32) the demo above takes many minutes.  A probe of a few ms decides:
# when a low-precision matmul is more than SLOW_FACTOR times slower than float32, the demo runs a
# smaller model (every recipe still appears, with a correct result) and says why.
SLOW_FACTOR = 4.0
SMALL_DEMO = {"--hidden": "128", "--batch-size": "64"}


def matmul_slowdown(n: int = 256, repeats: int = 3) -> dict[str, float]:
    """``{dtype: time of an n x n matmul / float32's}`` for float16 and bfloat16 with torch (one thread);
    empty when torch is not installed."""
    try:
        import torch
    except ImportError:  # pragma: no cover
        return {}
    import time

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        times = {}
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            a = torch.randn(n, n).to(dtype)
            a @ a  # warm-up
            start = time.perf_counter()
            for _ in range(repeats):
                a @ a
            times[str(dtype).replace("torch.", "")] = (time.perf_counter() - start) / repeats
    finally:
        torch.set_num_threads(threads)
    return {k: v / times["float32"] for k, v in times.items() if k != "float32"}


def demo_args(slowdown: dict[str, float]) -> tuple[list[str], str | None]:
    """The demo's ``compare`` arguments for a CPU with these matmul slowdowns, and the note saying why
    it was shrunk (None: the full-size demo)."""
    args = list(DEMO_ARGS)
    slow = {k: v for k, v in slowdown.items() if v > SLOW_FACTOR}
    if not slow:
        return args, None
    for flag, value in SMALL_DEMO.items():
        args[args.index(flag) + 1] = value
    detail = ", ".join(f"{k} {v:.0f}x" for k, v in sorted(slow.items()))
    return args, (f"this CPU has no fast low-precision matmul ({detail} slower than float32 in a probe): the demo "
                  f"runs a smaller model (hidden {SMALL_DEMO['--hidden']}, batch {SMALL_DEMO['--batch-size']}); "
                  "its speed ratios describe this CPU, not a GPU or an AMX CPU")


def demo(args: argparse.Namespace) -> int:
    from .measurement import can_isolate, run_isolated

    slowdown = run_isolated(_probe) if can_isolate() else matmul_slowdown()  # the runs fork from this process
    argv, note = demo_args(slowdown)
    print("matmul time vs float32: "
          + (", ".join(f"{k} {v:.1f}x" for k, v in slowdown.items()) or "not probed (no torch)"))
    if note:
        print(f"note: {note}")
    return compare(build_parser().parse_args(["compare", *argv, "--out", args.out]
                                             + (["--quiet"] if args.quiet else [])), slowdown=slowdown)


def build_parser() -> argparse.ArgumentParser:
    from ..recipes import RECIPE_NAMES
    from .compare import FRAMEWORKS

    parser = argparse.ArgumentParser(prog="mpx", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("compare", help="train one model under several recipes and frameworks")
    p.add_argument("--frameworks", nargs="+", choices=list(FRAMEWORKS), default=list(FRAMEWORKS))
    p.add_argument("--recipes", nargs="+", default=list(RECIPE_NAMES), metavar="RECIPE",
                   help=f"any of {', '.join(RECIPE_NAMES)} (32-true is always run as the baseline)")
    p.add_argument("--steps", type=_positive_int, default=300)
    p.add_argument("--batch-size", type=_positive_int, default=128)
    p.add_argument("--hidden", type=_positive_int, default=512, help="MLP width")
    p.add_argument("--depth", type=_positive_int, default=2, help="hidden layers")
    p.add_argument("--lr", type=_positive_float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=_nonnegative_int, default=0, help="intra-op threads (0: framework default)")
    p.add_argument("--inject", type=int, nargs="*", default=[], metavar="STEP",
                   help="steps whose loss is made inf, to show skip and recovery")
    p.add_argument("--no-skip-nonfinite", action="store_true",
                   help="let recipes without loss scaling apply non-finite steps (see the NaNs)")
    p.add_argument("--out", default="mp_report", help="report folder")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--in-process", action="store_true",
                   help="run every recipe in this process instead of one process each (memory then depends on order)")
    p.set_defaults(func=compare)

    p = sub.add_parser("presets", help="scale trajectories of every preset on one overflow pattern")
    p.add_argument("--steps", type=_positive_int, default=6000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rate", type=_probability, default=0.002, help="overflow probability per step")
    p.add_argument("--growth-interval", type=_positive_int, default=200)
    p.set_defaults(func=presets)

    p = sub.add_parser("demo", help="make demo: a short compare of every recipe in both frameworks",
                       description=f"mpx compare {' '.join(DEMO_ARGS)}")
    p.add_argument("--out", default="mp_report", help="report folder")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=demo)
    return parser


def _checked(kind: type, test: Callable[[float], bool], rule: str) -> Callable[[str], Any]:
    """An argparse ``type=`` that parses ``kind`` and requires ``test(value)``."""
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
        if not test(value):
            raise argparse.ArgumentTypeError(f"{value} must be {rule}")
        return value
    return parse


_positive_int = _checked(int, lambda v: v >= 1, ">= 1")
_nonnegative_int = _checked(int, lambda v: v >= 0, ">= 0")
_positive_float = _checked(float, lambda v: v > 0 and math.isfinite(v), "a finite number > 0")
_probability = _checked(float, lambda v: 0.0 <= v <= 1.0, "in [0, 1]")


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
