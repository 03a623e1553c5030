"""Command line: ``python -m mp_callbacks`` (also installed as ``mpx``).

Subcommands:
  compare  train one model under each recipe, each run in a process of its
           own: your LightningModule (--lightning) or Keras model (--keras),
           else the built-in MLP in Lightning and Keras; print/write the
           comparison (samples/s, speed-up, step time with its spread, peak
           memory split into model state and the rest, bytes/param, final
           loss and metric, overflows, skipped steps, a 32-true control run,
           the CPU's features) and end with the recipe to use, and why.
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

from ..fp8 import GRANULARITIES
from ..loss_scale import PRESETS, DynamicLossScaler, ScalerConfig
from ..memory import bytes_per_param
from ..recipes import RECIPE_NAMES, get_recipe
from .machine import matmul_probe, matmul_slowdown
from .session import quiet_frameworks

__all__ = ["build_parser", "compare", "compare_own_model", "demo", "demo_args", "fp8_variants", "main",
           "matmul_slowdown", "presets"]

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


_quiet_frameworks = quiet_frameworks


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
    """``mpx compare``: the built-in MLP on digits, or the user's model (``--lightning`` / ``--keras``)."""
    if args.lightning or args.keras:
        return compare_own_model(args, slowdown)
    from .compare import FRAMEWORKS, RunSpec
    from .session import PlannedRun, caller, finish, machine_notes, run_plan, with_control

    try:
        recipes = fp8_variants(args.recipes, args.fp8_granularity)
    except ValueError as exc:
        raise SystemExit(f"mpx compare: error: {exc}") from None
    try:
        spec = RunSpec(steps=args.steps, batch_size=args.batch_size or 128, hidden=args.hidden or 512,
                       depth=args.depth or 2,
                       seed=args.seed, inject=tuple(args.inject), lr=args.lr, threads=args.threads,
                       skip_nonfinite=not args.no_skip_nonfinite)
    except ValueError as exc:
        raise SystemExit(f"mpx compare: error: {exc}") from None
    _quiet_frameworks()
    frameworks = list(dict.fromkeys(args.frameworks or FRAMEWORKS))
    runners = {framework: _load_runner(framework) for framework in frameworks}
    _quiet_frameworks()  # again: Lightning resets its logger level when it is imported
    call = caller(not args.in_process)
    machine, notes = machine_notes(call, slowdown, _probe)  # in a child too: this process runs nothing itself
    print("\n".join(notes))
    # the control: 32-true again, last in each framework's series (run-to-run noise, order independence)
    plan, unsupported = [], []
    for framework in frameworks:
        run = runners[framework]
        for recipe, control in with_control(recipes):
            if not getattr(run, "supports", lambda _: True)(recipe):
                unsupported.append(f"{framework} {recipe}")
                continue
            plan.append(PlannedRun(framework, recipe, run, (recipe, spec), spec.steps, control))
    results = run_plan(plan, call, quiet=args.quiet)
    extra = [f"not run (the adapter does not implement the recipe yet): {', '.join(unsupported)}"
             ] if unsupported else []
    if "keras" in frameworks and _keras_backend() == "tensorflow":
        extra.append(KERAS_TF_NOTE)
    finish(results, spec, args.out, machine, notes, goal=args.goal, extra_notes=extra)
    return 0


def fp8_variants(recipes: Sequence[str], granularities: Sequence[str] | None) -> list[str]:
    """The canonical labels of ``recipes`` with ``fp8-mixed`` replaced, where it stands, by one
    ``fp8-mixed[<granularity>]`` per granularity (appended when ``fp8-mixed`` is not among them);
    a bad recipe or granularity is a ``RecipeError`` listing the valid ones."""
    from ..recipes import recipe_label

    labels = [recipe_label(r) for r in recipes]
    if not granularities:
        return labels
    variants = [recipe_label(f"fp8-mixed[{g}]") for g in granularities]
    if "fp8-mixed" not in labels:
        return list(dict.fromkeys([*labels, *variants]))
    at = labels.index("fp8-mixed")
    rest = [r for r in labels if r != "fp8-mixed"]
    return list(dict.fromkeys([*rest[:at], *variants, *rest[at:]]))


def compare_own_model(args: argparse.Namespace, slowdown: dict[str, float] | None = None) -> int:
    """`mpx compare --lightning pkg.mod:make_module [--datamodule ..]` or `--keras pkg.mod:build_model --data ..`."""
    from .own_model import ModelSpec, compare_recipes, load_factory

    framework = "lightning" if args.lightning else "keras"
    wrong = [f"mpx compare: error: {text}" for text, bad in (
        ("--lightning and --keras: give one model", args.lightning and args.keras),
        ("--keras needs --data pkg.module:make_dataset", args.keras and not args.data),
        ("--datamodule goes with --lightning (Keras: --data)", args.datamodule and not args.lightning),
        ("--data goes with --keras (Lightning: --datamodule)", args.data and not args.keras),
    ) if bad]
    builtin = [flag for flag, given in (("--hidden", args.hidden is not None), ("--depth", args.depth is not None),
                                        ("--inject", bool(args.inject)), ("--frameworks", args.frameworks is not None),
                                        ("--no-skip-nonfinite", args.no_skip_nonfinite),
                                        ("--batch-size", bool(args.lightning and args.batch_size))) if given]
    if builtin:
        wrong.append(f"mpx compare: error: {', '.join(builtin)} describe the built-in model; --{framework} "
                     "compares your own")
    if wrong:
        raise SystemExit(wrong[0])
    _quiet_frameworks()
    try:
        make_model = load_factory(args.lightning or args.keras)
        data = load_factory(args.datamodule or args.data) if (args.datamodule or args.data) else None
        spec = ModelSpec(framework=framework, model=args.lightning or args.keras, data=args.datamodule or args.data,
                         steps=args.steps, seed=args.seed, batch_size=args.batch_size, val_batches=args.val_batches,
                         metric=args.metric, higher_is_better=args.higher_is_better, loss=args.loss, lr=args.lr,
                         threads=args.threads)
        compare_recipes(make_model, data, spec=spec, recipes=fp8_variants(args.recipes, args.fp8_granularity),
                        goal=args.goal, out=args.out,
                        verbose=True, show_progress=not args.quiet, in_process=args.in_process, slowdown=slowdown)
    except (ValueError, ImportError, AttributeError, TypeError) as exc:
        raise SystemExit(f"mpx compare: error: {exc}") from None
    return 0


_probe = matmul_probe


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


COMPARE_DESCRIPTION = """\
Train one model under each recipe (same initial weights, same batches in the same order, a process
per run, 32-true run again last as the control) and end with the recipe to use on this machine.

  mpx compare                                  the built-in MLP on digits, Lightning and Keras
  mpx compare --lightning pkg.mod:make_module [--datamodule pkg.mod:make_datamodule]
  mpx compare --keras pkg.mod:build_model --data pkg.mod:make_dataset [--loss NAME]

Factories are imported from the current directory or PYTHONPATH and called without arguments."""


def build_parser() -> argparse.ArgumentParser:
    from ..recipes import RECIPE_NAMES
    from ..recommend import GOALS
    from .compare import FRAMEWORKS

    parser = argparse.ArgumentParser(prog="mpx", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("compare", help="train one model under several recipes and report which to use",
                       description=COMPARE_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    own = p.add_argument_group("your own model (default: the built-in MLP on digits, both frameworks)")
    own.add_argument("--lightning", metavar="PKG.MODULE:FACTORY",
                     help="a function returning your LightningModule (its train_dataloader, or --datamodule)")
    own.add_argument("--datamodule", metavar="PKG.MODULE:FACTORY", help="a function returning a LightningDataModule")
    own.add_argument("--keras", metavar="PKG.MODULE:FACTORY", help="a function returning your Keras model "
                     "(compiled or not)")
    own.add_argument("--data", metavar="PKG.MODULE:FACTORY",
                     help="a function returning the Keras data: (x, y[, w]) arrays, a dataset of batches, or "
                          "{'train': ..., 'validation': ...}")
    own.add_argument("--loss", help="Keras, uncompiled model: a loss name or PKG.MODULE:ATTR")
    own.add_argument("--metric", help="the validation metric to compare (default: the first logged one with 'loss' "
                     "in its name; without validation data: the training loss)")
    direction = own.add_mutually_exclusive_group()
    direction.add_argument("--higher-is-better", dest="higher_is_better", action="store_true", default=None,
                           help="the metric is better when larger (default: from its name)")
    direction.add_argument("--lower-is-better", dest="higher_is_better", action="store_false")
    own.add_argument("--val-batches", type=_positive_int, default=8, help="validation batches per run")
    p.add_argument("--goal", choices=GOALS, default="speed",
                   help="what the recommendation optimizes among recipes whose metric stays within tolerance")
    p.add_argument("--frameworks", nargs="+", choices=list(FRAMEWORKS), default=None,
                   help="built-in model: the frameworks to run (default: both)")
    p.add_argument("--recipes", nargs="+", default=list(RECIPE_NAMES), metavar="RECIPE",
                   help=f"any of {', '.join(RECIPE_NAMES)} (32-true is always run as the baseline)")
    p.add_argument("--fp8-granularity", nargs="+", type=_granularity, default=None, metavar="KIND",
                   help=f"run fp8-mixed once per FP8 granularity ({', '.join(GRANULARITIES)}), each a row "
                        "fp8-mixed[KIND], on the built-in model or yours; also accepted in --recipes as "
                        "fp8-mixed[KIND]")
    p.add_argument("--steps", type=_positive_int, default=300)
    p.add_argument("--batch-size", type=_positive_int, default=None,
                   help="built-in model: 128; Keras arrays: the batch to cut them in (default: 32, as Keras' fit); "
                        "Lightning: set by your loader")
    p.add_argument("--hidden", type=_positive_int, default=None, help="built-in MLP width (512)")
    p.add_argument("--depth", type=_positive_int, default=None, help="built-in MLP hidden layers (2)")
    p.add_argument("--lr", type=_positive_float, default=1e-3, help="built-in model, or an uncompiled Keras model")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=_nonnegative_int, default=0, help="intra-op threads (0: framework default)")
    p.add_argument("--inject", type=int, nargs="*", default=[], metavar="STEP",
                   help="built-in model: steps whose loss is made inf, to show skip and recovery")
    p.add_argument("--no-skip-nonfinite", action="store_true",
                   help="built-in model: let recipes without loss scaling apply non-finite steps (see the NaNs)")
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


def _granularity(text: str) -> str:
    """An argparse ``type=``: an FP8 granularity (the error lists the valid ones)."""
    kind = text.strip().lower()
    if kind not in GRANULARITIES:
        raise argparse.ArgumentTypeError(f"{text!r} is not an FP8 granularity; valid: {', '.join(GRANULARITIES)}")
    return kind


_positive_int = _checked(int, lambda v: v >= 1, ">= 1")
_nonnegative_int = _checked(int, lambda v: v >= 0, ">= 0")
_positive_float = _checked(float, lambda v: v > 0 and math.isfinite(v), "a finite number > 0")
_probability = _checked(float, lambda v: 0.0 <= v <= 1.0, "in [0, 1]")


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
