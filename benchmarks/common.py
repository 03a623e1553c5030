"""Alternating side-by-side timing: every round runs each variant once, in turn (order reversed every other round).

Ratios are computed per round (ours / native on the same round, so slow
phases of the machine hit both) and summarised by their median.  No
thresholds here: the scripts print figures, the README records them.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any


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


def per_step(body: Callable[[], Any], steps: int) -> Callable[[], tuple[float, float]]:
    """A variant for :func:`alternate` that runs ``body()`` ``steps`` times: its (wall, cpu) seconds per step
    (see :data:`CLOCKS`)."""
    def once() -> tuple[float, float]:
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(steps):
            body()
        return (time.perf_counter() - t0) / steps, (time.process_time() - c0) / steps
    return once


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


def ratios(times: Mapping[str, list[float]], ours: str, native: str) -> list[float]:
    """The per-round ratios ours/native."""
    return [a / b for a, b in zip(times[ours], times[native])]


def summary(times: Mapping[str, list[float]], pairs: list[tuple[str, str, str]]) -> dict[str, Any]:
    """Per variant: median step over rounds with the min and max round; per pair: the median per-round ratio
    with its min and max round, and the control's (the same native variant run twice) when there is one."""
    out: dict[str, Any] = {"variants": {}, "ratios": []}
    for name, ts in times.items():
        out["variants"][name] = {"median_ms": 1000 * statistics.median(ts), "min_ms": 1000 * min(ts),
                                 "max_ms": 1000 * max(ts), "rounds_ms": [1000 * t for t in ts]}
    for ours, native, target in pairs:
        rs = ratios(times, ours, native)
        row: dict[str, Any] = {"ours": ours, "native": native, "target": target,
                               "median": statistics.median(rs), "min": min(rs), "max": max(rs)}
        control = control_name(native)
        if control in times:
            cs = ratios(times, control, native)
            row["control"] = {"median": statistics.median(cs), "min": min(cs), "max": max(cs)}
        out["ratios"].append(row)
    return out


def print_table(title: str, times: Mapping[str, list[float]], pairs: list[tuple[str, str, str]]) -> dict[str, Any]:
    """``pairs``: (ours, native, target text); a native with a control variant gets its control ratio beside.
    Spreads are the min-max over rounds.  Returns :func:`summary` (with the title)."""
    data = summary(times, pairs)
    data["title"] = title
    print(f"\n{title}")
    for name, v in data["variants"].items():
        print(f"  {name:<46} median step {v['median_ms']:9.3f} ms  (rounds {v['min_ms']:.3f}-{v['max_ms']:.3f}, "
              f"{len(v['rounds_ms'])} rounds)")
    for row in data["ratios"]:
        line = (f"  ratio {row['ours']} / {row['native']}: {row['median']:.3f} ({row['min']:.3f}-{row['max']:.3f})"
                f"   target {row['target']}")
        if "control" in row:
            c = row["control"]
            line += f"   control: {c['median']:.3f} ({c['min']:.3f}-{c['max']:.3f})"
        print(line)
    return data


CLOCKS = ("wall", "cpu")
"""Each fit is timed twice: wall time (what a user waits) and this process's CPU time (user + system:
what the fit itself computed, robust to other jobs sharing the machine, which only stretch the wall time)."""


def fit_figures(wall: list[float], cpu: list[float]) -> tuple[float, float]:
    """A fit's (wall, cpu) seconds per step: the median of its timed windows
    (mp_callbacks.app.measurement.step_timing)."""
    from mp_callbacks.app.measurement import step_timing

    return step_timing(wall).median_ms / 1000, step_timing(cpu).median_ms / 1000


def by_clock(times: Mapping[str, list[Any]]) -> dict[str, dict[str, list[float]]]:
    """``{clock: {variant: per-round seconds}}`` from per-round ``(wall, cpu)`` pairs."""
    return {clock: {name: [t[i] for t in ts] for name, ts in times.items()} for i, clock in enumerate(CLOCKS)}


def print_tables(title: str, times: Mapping[str, list[Any]], pairs: list[tuple[str, str, str]]) -> dict[str, Any]:
    """:func:`print_table` once per clock (wall, then CPU time); returns ``{clock: summary}``."""
    return {clock: print_table(f"{title} [{clock} time]", t, pairs) for clock, t in by_clock(times).items()}


def machine_line(threads: int | None = None) -> str:
    """CPU model, the low-precision features found (mp_callbacks.app.machine), torch's version, threads."""
    from mp_callbacks.app.machine import cpu_model, features

    found = [k for k, v in features().items() if v and k in ("amx_bf16", "amx_fp16", "avx512_bf16",
                                                                  "avx512_fp16", "avx512f", "avx2")]
    line = f"CPU: {cpu_model() or 'unknown'}; features: {', '.join(found) or 'none found'}"
    try:
        import torch

        line += f"; torch {torch.__version__}"
    except ImportError:  # pragma: no cover
        pass
    return line + (f"; {threads} thread(s)" if threads else "")


def pin_cpus(threads: int) -> str:
    """Pin this process (and the threads it starts) to the last ``threads`` of the CPUs it could run on when
    first asked; returns ``"; pinned to CPU(s) ..."`` for the machine line, or ``""`` where it runs unpinned (no
    ``os.sched_setaffinity``, or ``threads`` not fewer than those CPUs: the first set again).

    Why: on the shared 2-vCPU guests a 1-thread step that the scheduler moves between the vCPUs spreads
    +-8 % step to step; pinned, +-3 % (lock-step pairs' quartiles, benchmarks/README.md)."""
    if not hasattr(os, "sched_setaffinity"):
        return ""
    if not _FIRST_CPUS:
        _FIRST_CPUS.extend(sorted(os.sched_getaffinity(0)))
    chosen = _FIRST_CPUS[-threads:] if threads < len(_FIRST_CPUS) else _FIRST_CPUS
    os.sched_setaffinity(0, chosen)
    return f"; pinned to CPU(s) {','.join(map(str, chosen))}" if chosen is not _FIRST_CPUS else ""


_FIRST_CPUS: list[int] = []  # the CPUs this process could run on before pin_cpus first pinned it


def bytes_by_dtype(per_dtype: Mapping[str, float]) -> str:
    """``{dtype: bytes}`` as ``"170,004 bf16"`` (several dtypes joined by ``+``; ``-`` when empty)."""
    short = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
    return " + ".join(f"{b:,.0f} {short.get(d, d)}" for d, b in sorted(per_dtype.items())) or "-"


def quiet_torch_worker() -> None:
    """In a torchrun rank: Lightning's and Python's chatter off, one intra-op thread."""
    import lightning.pytorch  # noqa: F401 - it sets its loggers' levels on import: quiet them after
    import torch

    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    logging.getLogger("lightning.fabric").setLevel(logging.ERROR)
    torch.set_num_threads(1)


def torchrun_self(script: str, worker: Callable[[list[str]], None]) -> None:
    """``worker(argv)`` in each of 2 gloo ranks: run it here when under torchrun, else relaunch ``script`` with it."""
    import os
    import socket
    import subprocess
    import sys
    from pathlib import Path

    if "LOCAL_RANK" in os.environ:
        worker(sys.argv[1:])
        return
    with socket.socket() as sock:  # a free port for the rendezvous
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={port}",
           str(Path(script).resolve()), *sys.argv[1:]]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    sys.exit(subprocess.run(cmd, cwd=Path(__file__).resolve().parents[1], env=env).returncode)


def write_json(path: str | None, data: Any) -> None:
    """Write ``data`` (with the machine line) to ``path`` as JSON, when a path was given."""
    if path:
        import json

        with open(path, "w") as fh:
            json.dump({"machine": machine_line(), "results": data}, fh, indent=2)
        print(f"\nfigures written to {path}")


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
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the figures to PATH (JSON)")
    parser.add_argument("--no-pin", action="store_true",
                        help="let the scheduler place the process (default: pinned to --threads CPUs where the "
                             "benchmark supports it: pin_cpus)")
    return parser


def thread_specs(args: argparse.Namespace) -> Iterator[tuple[int, Any]]:
    """``(threads, RunSpec)`` for each ``--threads`` value, with Lightning's and Python's chatter off."""
    from mp_callbacks.app.compare import RunSpec

    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    for threads in args.threads:
        yield threads, RunSpec(steps=args.steps, batch_size=args.batch_size, hidden=args.hidden,
                               depth=args.depth, threads=threads)
