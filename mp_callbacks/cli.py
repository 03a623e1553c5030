"""Command line: ``python -m mp_callbacks`` (also installed as ``mpx``).

Subcommands:
  demo     the scale trajectory of every preset on one overflow pattern,
           the recipes table and the bytes/param estimate (core only; no
           framework needed).
"""

from __future__ import annotations

import argparse
import math
import sys
from typing import Sequence

import numpy as np

from .master import bytes_per_param
from .recipes import RECIPE_NAMES, get_recipe
from .scaler import PRESETS, DynamicLossScaler, ScalerConfig

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


def demo(args: argparse.Namespace) -> int:
    flags = overflow_pattern(args.steps, args.seed, args.rate)
    print(f"Loss-scale trajectories over {args.steps} steps, {int(flags.sum())} injected overflows "
          f"(seed {args.seed}), growth_interval={args.growth_interval} for every preset:\n")
    header = f"{'preset':<10} {'init':>8} {'final':>8} {'min':>8} {'max':>8} {'skipped':>7} {'growths':>7}  log2(scale) over time"
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mpx", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("demo", help="scale trajectories of every preset on one overflow pattern")
    p.add_argument("--steps", type=_positive_int, default=6000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rate", type=_probability, default=0.002, help="overflow probability per step")
    p.add_argument("--growth-interval", type=_positive_int, default=200)
    p.set_defaults(func=demo)
    return parser


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be >= 1")
    return value


def _probability(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"{value} must be in [0, 1]")
    return value


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
