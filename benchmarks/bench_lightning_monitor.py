"""Lightning: the cost of lightning_ext.MixedPrecisionMonitor(log_every_n_steps=50).

    python benchmarks/bench_lightning_monitor.py [--threads 1 2] [--rounds 7] [--steps 100] [--recipes ...]

Each recipe trains the same MLP on the same batches with our plugin
(:func:`mp_callbacks.app.lightning_runner.fit_once`), once with the monitor and once
without, alternating in one process.  The monitor's hooks run inside the timed
step (the timer starts before its ``on_train_batch_start`` and stops after its
``on_train_batch_end``).  Its heavier work (meters, host reads, logging) runs
every ``log_every_n_steps`` steps, so the per-fit figure is the **mean** step
time (warm-up excluded), which amortizes those steps; a median would hide them.
``--steps`` should span several logging periods (default 100 = 2 periods).
Two monitor configurations: the defaults (overflow attribution off), and
``attribute_overflows=True`` (the overflow tracer's per-module forward and
gradient hooks, the debugging mode).
The trainer has no logger (``logger=False``): the cost of writing metrics is the
logger's, not the monitor's.  Ratio = median over rounds of with / without.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from common import (  # noqa: E402
    alternate,
    base_parser,
    machine_line,
    print_table,
    thread_specs,
    with_controls,
    write_json,
)

from lightning_ext import MixedPrecision, MixedPrecisionMonitor  # noqa: E402
from mp_callbacks.app.compare import RunSpec  # noqa: E402
from mp_callbacks.app.lightning_runner import fit_once  # noqa: E402


def measure(recipe: str, spec: RunSpec, monitor: dict | None, log_every: int):
    def once() -> float:
        callbacks = [MixedPrecisionMonitor(log_every_n_steps=log_every, **monitor)] if monitor is not None else []
        _, recorder = fit_once(MixedPrecision(recipe, "cpu"), spec, callbacks=callbacks)
        timed = recorder.timed()
        return sum(timed) / len(timed)
    return once


def main() -> None:
    parser = base_parser(__doc__, rounds=5, steps=100, hidden=512, batch_size=256)
    parser.add_argument("--log-every", type=int, default=50)
    parser.add_argument("--recipes", nargs="+", default=["16-mixed", "bf16-master"])
    args = parser.parse_args()
    summaries = []
    for threads, spec in thread_specs(args):
        torch.set_num_threads(threads)
        print(machine_line(threads))
        variants = {}
        for recipe in args.recipes:
            variants[f"{recipe} + monitor"] = measure(recipe, spec, {}, args.log_every)
            variants[f"{recipe} + monitor + attribution"] = measure(
                recipe, spec, {"attribute_overflows": True}, args.log_every)
            variants[f"{recipe}"] = measure(recipe, spec, None, args.log_every)
        times = alternate(with_controls(variants, list(args.recipes)), args.rounds)
        pairs = []
        for r in args.recipes:
            pairs += [(f"{r} + monitor", r, "<= 1.05"), (f"{r} + monitor + attribution", r, "opt-in, no target")]
        summaries.append(print_table(
            f"Lightning MixedPrecisionMonitor(log_every_n_steps={args.log_every}), MLP {args.depth}x{args.hidden}, "
            f"batch {args.batch_size}, {args.steps} steps, {threads} thread(s); mean step per fit", times, pairs,
        ))
    write_json(args.json, summaries)


if __name__ == "__main__":
    main()
