"""The one timing harness of the benchmarks: variants take turns in rounds in one process, each reference
variant runs twice (the second run is its control), and a ratio is the median of per-round ratios.

How it measures (the rule every timed figure of ``benchmarks/README.md`` follows):

* every variant is built in the main thread, one after the other (seeds are process-wide), then each trains
  in a thread of its own; the threads take turns, so exactly one variant computes at a time and the others
  wait without using the CPU;
* a turn is one round of one variant: ``steps`` training steps (round 0 is an untimed warm-up turn of
  ``warmup`` steps); every round runs every variant once, in a fresh seeded order, never the same variant twice
  in a row (so a slow phase of the machine hits all variants alike, and no variant always follows the same
  neighbour);
* a variant's figure in a round: wall seconds and process CPU seconds per step over its turn (the sum of its
  steps' times, from :meth:`Clock.begin` to :meth:`Clock.end`, divided by ``steps``); a variant passes the turn
  at the start of its next step, so what its loop does between steps (fetching the batch, hooks) never runs
  beside another variant's timed step;
* a reference (native) variant is also built and run a second time, as an independent variant: its
  *control*.  ``control / reference`` per round shows the noise a ratio carries on this machine, now;
* a ratio ``ours / reference`` is the median over rounds of the per-round ratios, with their min-max;
* a *lead* (a copy of the first variant) is built and run first, its figures dropped: the variant built and
  started first ran 1-2 % slower than an identical one built later.

A variant is ``build(clock) -> train``: ``build`` makes the model, optimizer and loop (main thread) and returns
``train()``, which trains ``clock.total`` steps, calling ``clock.begin()`` before and ``clock.end()`` after each
(a framework callback or a plain loop, :func:`loop`).  :func:`machine_line` is printed with every figure.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import random
import statistics
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = ["Clock", "Build", "Variant", "loop", "run_rounds", "with_controls", "control_name", "summarize", "markdown",
           "machine_line", "native_of", "parser", "setup", "write_json"]

RECIPES = ("32-true", "16-mixed", "bf16-mixed", "16-master", "bf16-master", "bf16-kahan", "bf16-sr", "fp8-mixed")
NATIVE_RECIPES = ("32-true", "16-mixed", "bf16-mixed")
OPTIMIZERS = ("default", "foreach", "fused")


def native_of(recipe: str) -> str:
    """The native recipe ``recipe`` is compared with: itself where the framework has it, ``16-mixed`` for
    ``16-master`` (both scale the loss of float16 compute), else ``bf16-mixed``."""
    if recipe in NATIVE_RECIPES:
        return recipe
    return "16-mixed" if recipe == "16-master" else "bf16-mixed"


@dataclasses.dataclass(frozen=True)
class Variant:
    """What a variant runs: the side (``ours``: this project's adapter; ``native``: the framework's own mixed
    precision), the recipe, and the user's optimizer (torch's AdamW: its default implementation, ``foreach=True``
    or ``fused=True``; Keras: its AdamW), which both sides run untouched."""

    side: str
    recipe: str
    optimizer: str = "default"

    def __post_init__(self) -> None:
        if self.side not in ("ours", "native") or self.optimizer not in OPTIMIZERS:
            raise ValueError(f"bad variant {self}")
        if self.recipe not in (NATIVE_RECIPES if self.side == "native" else RECIPES):
            raise ValueError(f"{self.side} has no recipe {self.recipe!r}")

    @property
    def name(self) -> str:
        return f"{self.side} {self.recipe}" + ("" if self.optimizer == "default" else
                                                f", AdamW({self.optimizer}=True)")

    def reference(self) -> Variant:
        """The native variant this one is compared with (the same optimizer)."""
        return Variant("native", native_of(self.recipe), self.optimizer)


class _Turns:
    """Whose turn it is: every variant once per round, a fresh seeded order each round, never the same variant
    twice in a row.  ``stop()`` (a variant failed) lets every variant run on without waiting."""

    def __init__(self, n: int, seed: int = 0) -> None:
        self.cond = threading.Condition()
        self.n, self.pos, self.stopped = n, 0, False
        self._rng = random.Random(seed)
        self.order = list(range(n))

    def _next_order(self) -> None:
        if self.n <= 2:  # A B A B: the only order with no variant twice in a row
            return
        last = self.order[-1]
        while True:
            order = self._rng.sample(range(self.n), self.n)
            if order[0] != last:
                self.order = order
                return

    def current(self) -> int:
        return self.order[self.pos]

    def wait(self, i: int) -> None:
        with self.cond:
            self.cond.wait_for(lambda: self.stopped or self.current() == i)

    def passed(self) -> None:
        with self.cond:
            self.pos += 1
            if self.pos == self.n:
                self.pos = 0
                self._next_order()
            self.cond.notify_all()

    def stop(self) -> None:
        with self.cond:
            self.stopped = True
            self.cond.notify_all()


class Clock:
    """One variant's turn-taking step clock.  ``total``: the steps its ``train()`` must run."""

    def __init__(self, turns: _Turns, index: int, warmup: int, steps: int, rounds: int,
                 done: threading.Barrier) -> None:
        self._turns, self._index, self._done = turns, index, done
        self._sizes = [warmup, *([steps] * rounds)] if warmup else [steps] * rounds
        self._timed_from = 1 if warmup else 0
        self.total = sum(self._sizes)
        self.rounds: list[list[float]] = [[0.0, 0.0] for _ in self._sizes]  # per turn: wall, cpu seconds
        self._turn = self._in_turn = self._steps = 0
        self._holding = False  # the turn ended with the last step; passed at the next begin()
        self._t0 = self._c0 = 0.0

    def begin(self) -> None:
        """Before a step: at a turn's first step, pass the turn this variant still holds (its last turn ended with
        the previous step: what its loop did since ran while no other variant was timed), wait for its next turn;
        then start the clocks."""
        if self._in_turn == 0:
            if self._holding:
                self._holding = False
                self._turns.passed()
            self._turns.wait(self._index)
        self._t0, self._c0 = time.perf_counter(), time.process_time()

    def end(self) -> None:
        """After a step: stop the clocks.  A turn's last step keeps the turn until the next :meth:`begin`; after the
        last step of all, pass it and wait until every variant has taken its last step (no set-up or teardown runs
        beside a timed step)."""
        wall, cpu = time.perf_counter() - self._t0, time.process_time() - self._c0
        turn = self.rounds[self._turn]
        turn[0] += wall
        turn[1] += cpu
        self._steps += 1
        self._in_turn += 1
        if self._in_turn == self._sizes[self._turn]:
            self._turn += 1
            self._in_turn = 0
            if self._steps == self.total:
                self._turns.passed()
                self._done.wait()
            else:
                self._holding = True

    def figures(self) -> list[tuple[float, float]]:
        """``(wall, cpu)`` seconds per step of each timed round."""
        return [(w / n, c / n) for (w, c), n in zip(self.rounds[self._timed_from:], self._sizes[self._timed_from:])]


Build = Callable[[Clock], Callable[[], Any]]
"""``build(clock) -> train``: a variant (see the module's rule)."""

LEAD = "(lead: a copy of the first variant, dropped)"


def loop(clock: Clock, step: Callable[[], Any]) -> Callable[[], None]:
    """``train()`` for a variant whose step is a plain call: ``clock.total`` steps between begin and end."""
    def train() -> None:
        for _ in range(clock.total):
            clock.begin()
            step()
            clock.end()
    return train


def control_name(name: str) -> str:
    """The name of ``name``'s control variant (the same variant built and run a second time)."""
    return f"{name} (control)"


def with_controls(variants: Mapping[str, Build], references: Sequence[str]) -> dict[str, Build]:
    """``variants`` plus a control of each of ``references`` (built independently, from the same recipe)."""
    out = dict(variants)
    for name in references:
        if name in variants:
            out[control_name(name)] = variants[name]
    return out


def run_rounds(variants: Mapping[str, Build], rounds: int, steps: int, warmup: int = 2, lead: bool = True,
               seed: int = 0) -> dict[str, list[tuple[float, float]]]:
    """Run the variants in turns (the module's rule); returns ``{name: [(wall, cpu) s/step per round]}``."""
    if lead and variants:
        variants = {LEAD: next(iter(variants.values())), **variants}
    names = list(variants)
    turns = _Turns(len(names), seed)
    done = threading.Barrier(len(names))
    clocks = [Clock(turns, i, warmup, steps, rounds, done) for i in range(len(names))]
    trains = [variants[name](clock) for name, clock in zip(names, clocks)]
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            trains[i]()
            if clocks[i]._steps != clocks[i].total:
                raise RuntimeError(f"{names[i]!r} trained {clocks[i]._steps} steps, not {clocks[i].total}")
        except threading.BrokenBarrierError:
            pass  # another variant failed: its error is the one raised
        except BaseException as exc:  # noqa: BLE001 - re-raised in the main thread below
            errors.append(RuntimeError(f"variant {names[i]!r} failed: {type(exc).__name__}: {exc}"))
            errors[-1].__cause__ = exc
            turns.stop()
            done.abort()

    threads = [threading.Thread(target=run, args=(i,), name=f"variant-{i}") for i in range(len(names))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return {name: clock.figures() for name, clock in zip(names, clocks) if name != LEAD}


def _spread(values: Sequence[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summarize(times: Mapping[str, Sequence[tuple[float, float]]],
              pairs: Sequence[tuple[str, str]]) -> dict[str, Any]:
    """Per variant its median ms per step (wall, CPU); per ``(ours, reference)`` pair the median per-round ratio
    with its min-max, in wall and CPU time, and the control's (``control / reference``) when it ran."""
    out: dict[str, Any] = {"variants": {}, "ratios": []}
    for name, ts in times.items():
        out["variants"][name] = {clock: {k: 1000 * v for k, v in _spread([t[i] for t in ts]).items()}
                                 for i, clock in enumerate(("wall", "cpu"))}
    for ours, ref in pairs:
        if ours not in times or ref not in times:
            continue
        row: dict[str, Any] = {"ours": ours, "reference": ref}
        for i, clock in enumerate(("wall", "cpu")):
            row[clock] = _spread([a[i] / b[i] for a, b in zip(times[ours], times[ref])])
            if control_name(ref) in times:
                row[f"control_{clock}"] = _spread([a[i] / b[i] for a, b in zip(times[control_name(ref)],
                                                                              times[ref])])
        out["ratios"].append(row)
    return out


def _cell(s: dict[str, float] | None) -> str:
    return f"{s['median']:.3f} ({s['min']:.3f}-{s['max']:.3f})" if s else "-"


def markdown(title: str, data: Mapping[str, Any]) -> str:
    """The summary as two Markdown tables: the ratios (median and min-max over rounds, wall and CPU time, the
    control's beside), then every variant's ms per step."""
    lines = [f"### {title}", "", "| ours | reference | wall ratio | CPU ratio | control wall | control CPU |",
             "|---|---|---|---|---|---|"]
    for r in data["ratios"]:
        lines.append(f"| {r['ours']} | {r['reference']} | {_cell(r['wall'])} | {_cell(r['cpu'])} | "
                     f"{_cell(r.get('control_wall'))} | {_cell(r.get('control_cpu'))} |")
    lines += ["", "| variant | wall ms/step | CPU ms/step |", "|---|---|---|"]
    for name, v in data["variants"].items():
        lines.append(f"| {name} | {_cell(v['wall'])} | {_cell(v['cpu'])} |")
    return "\n".join(lines) + "\n"


# ---- the machine and the command line -------------------------------------------------------------------------

_FLAGS = ("avx512_bf16", "amx_bf16", "amx_fp16", "avx512_fp16", "avx512f", "avx2")
_PINNED: list[int] = []


def _cpuinfo() -> tuple[str, list[str]]:
    """The CPU's model name and the low-precision flags found in /proc/cpuinfo ("" and [] elsewhere)."""
    try:
        with open("/proc/cpuinfo") as fh:
            text = fh.read()
    except OSError:
        return platform.processor() or platform.machine(), []
    model = next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name")), "")
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return model or platform.machine(), [f for f in _FLAGS if f in flags]


def machine_line(threads: int | None = None) -> str:
    """CPU model and flags, the frameworks' versions (those imported), threads and the CPUs pinned."""
    model, flags = _cpuinfo()
    parts = [f"CPU: {model}; flags: {', '.join(flags) or 'none of ' + '/'.join(_FLAGS[:4])}"]
    for name in ("torch", "lightning", "tensorflow", "keras", "jax"):
        mod = sys.modules.get(name)
        if mod is not None and hasattr(mod, "__version__"):
            parts.append(f"{name} {mod.__version__}")
    if "keras" in sys.modules:
        parts.append(f"KERAS_BACKEND={os.environ.get('KERAS_BACKEND', 'tensorflow')}")
    if threads:
        parts.append(f"{threads} thread(s)")
    parts.append(f"pinned to CPU(s) {','.join(map(str, _PINNED))}" if _PINNED else "not pinned")
    return "; ".join(parts)


def pin(threads: int) -> None:
    """Pin this process (and the threads it starts) to the last ``threads`` of the CPUs it may run on (a step the
    scheduler moves between CPUs spreads more); nothing where there is no ``sched_setaffinity`` or no fewer."""
    if not hasattr(os, "sched_setaffinity"):
        return
    cpus = sorted(os.sched_getaffinity(0))
    if threads < len(cpus):
        os.sched_setaffinity(0, cpus[-threads:])
        cpus = cpus[-threads:]
    if threads == len(cpus) and len(cpus) < (os.cpu_count() or 0):  # pinned here, or by the parent process
        _PINNED[:] = cpus


def parser(doc: str | None, rounds: int = 7, steps: int = 30, warmup: int = 3) -> argparse.ArgumentParser:
    """The flags every timed script takes: ``--rounds``, ``--steps`` (per round), ``--warmup``, ``--threads``,
    ``--no-pin``, ``--json``."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=rounds, help="timed rounds (each variant once per round)")
    p.add_argument("--steps", type=int, default=steps, help="training steps per variant per round")
    p.add_argument("--warmup", type=int, default=warmup, help="untimed steps per variant before the rounds")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads (torch, TensorFlow); default 1")
    p.add_argument("--no-pin", action="store_true", help="do not pin the process to --threads CPUs")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the figures to PATH (JSON)")
    return p


def setup(args: argparse.Namespace, tensorflow: bool = False) -> None:
    """Pin the process (unless ``--no-pin``) and set the thread counts: torch's, and with ``tensorflow``
    TensorFlow's intra- and inter-op pools (call it before TensorFlow runs anything)."""
    if not args.no_pin:
        pin(args.threads)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    if "torch" in sys.modules or not tensorflow:
        import torch

        torch.set_num_threads(args.threads)
    if tensorflow:
        import tensorflow as tf

        tf.config.threading.set_intra_op_parallelism_threads(args.threads)
        tf.config.threading.set_inter_op_parallelism_threads(args.threads)


def write_json(path: str | None, data: Any, threads: int | None = None) -> None:
    """Write ``data`` with the machine line to ``path`` (when given)."""
    if path:
        with open(path, "w") as fh:
            json.dump({"machine": machine_line(threads), "results": data}, fh, indent=2, default=str)
        print(f"figures written to {path}")


def quiet() -> None:
    """Lightning's, TensorFlow's and Python's chatter off."""
    import logging
    import warnings

    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    warnings.filterwarnings("ignore")
    for name in ("lightning.pytorch", "lightning.fabric", "lightning", "tensorflow", "absl"):
        logging.getLogger(name).setLevel(logging.ERROR)
