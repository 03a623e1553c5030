"""Alternating side-by-side timing: every round runs each variant once, in turn (order reversed every other round).

Ratios are computed per round (ours / native on the same round, so slow
phases of the machine hit both) and summarised by their median.  No
thresholds here: the scripts print figures, the README records them.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import warnings
from typing import Any, Callable, Iterator, Mapping


def alternate(variants: Mapping[str, Callable[[], float]], rounds: int) -> dict[str, list[float]]:
    """Run each variant's ``measure() -> seconds per step`` ``rounds`` times, interleaved.

    The order alternates: even rounds run the variants in the given order, odd
    rounds in reverse (A B C, C B A, ...), so no variant always runs first or
    right after the same neighbour (warm caches, allocator state, a slow start).
    """
    times: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    for r in range(rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            times[name].append(variants[name]())
    return times


def ratio(times: Mapping[str, list[float]], ours: str, native: str) -> float:
    """Median over rounds of ours/native."""
    return statistics.median(a / b for a, b in zip(times[ours], times[native]))


def control_name(name: str) -> str:
    """The name of ``name``'s control variant: the same thing run a second time, as a separate variant."""
    return f"{name} (control)"


def with_controls(variants: Mapping[str, Callable[[], float]], natives: list[str]) -> dict[str, Callable[[], float]]:
    """``variants`` plus a control copy of each native variant, placed right after ours-and-native.

    A control runs exactly what its native runs; ``control / native`` measures
    how far two identical variants drift apart on this machine (the noise a
    ratio of ours / native carries).
    """
    out = dict(variants)
    for name in natives:
        out[control_name(name)] = variants[name]
    return out


def print_table(title: str, times: Mapping[str, list[float]], pairs: list[tuple[str, str, str]]) -> None:
    """``pairs``: (ours, native, target text); a native with a control variant gets its control ratio beside."""
    print(f"\n{title}")
    for name, ts in times.items():
        print(f"  {name:<42} median step {1000 * statistics.median(ts):8.3f} ms over {len(ts)} rounds")
    for ours, native, target in pairs:
        line = f"  ratio {ours} / {native}: {ratio(times, ours, native):.3f}   (target {target})"
        control = control_name(native)
        if control in times:
            line += f"   control {control} / {native}: {ratio(times, control, native):.3f}"
        print(line)


def base_parser(doc: str | None, rounds: int = 7, steps: int = 40, hidden: int = 1024, depth: int = 3,
                batch_size: int = 512) -> argparse.ArgumentParser:
    """The flags every benchmark takes: threads, rounds, steps and the MLP's size."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=rounds)
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--hidden", type=int, default=hidden)
    parser.add_argument("--depth", type=int, default=depth)
    parser.add_argument("--batch-size", type=int, default=batch_size)
    return parser


def thread_specs(args: argparse.Namespace) -> Iterator[tuple[int, Any]]:
    """``(threads, RunSpec)`` for each ``--threads`` value, with Lightning's and Python's chatter off."""
    from mp_callbacks.compare import RunSpec

    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    for threads in args.threads:
        yield threads, RunSpec(steps=args.steps, batch_size=args.batch_size, hidden=args.hidden,
                               depth=args.depth, threads=threads)
