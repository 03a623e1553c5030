"""Emulated FP8 (``fp8-mixed``) step time against ``bf16-mixed`` (and ``bf16-master``, ``32-true``).

    python benchmarks/bench_fp8.py [--threads 1 2] [--rounds 5] [--steps 30] [--batch-size 64]
                                   [--hidden 256] [--depth 2] [--frameworks lightning keras]
                                   [--granularities rowwise blockwise mxfp8]

Trains the ``mpx compare`` MLP on the same digits batches with AdamW under
``lightning_ext.MixedPrecision(recipe)`` for ``fp8-mixed``, ``bf16-mixed``,
``bf16-master`` (the storage ``fp8-mixed`` shares) and ``32-true``,
alternating in one process (order reversed every other round, a control copy
of ``bf16-mixed``), and prints, in wall and in CPU time, the step times (a
fit's figure: its median timed window, ``common.fit_figures``) and the median
per-round ratios fp8-mixed / bf16-mixed, fp8-mixed / bf16-master, fp8-mixed /
32-true, with the CPU model (``--json PATH`` also writes them).  Keras
(``mp_callbacks.app.keras_runner.fit_once``, ``model.fit``, TensorFlow unless KERAS_BACKEND says
otherwise) runs the same after Lightning with the first ``--threads`` value.

What the emulation costs, per FP8 matmul and step: the amax of the input, the
weight and the output gradient (a reduction each), the scale, clamp, cast to
float8 and back, and the multiply by the inverse scale for each of them, the
matmul in float32 on the dequantized values, and 3 scaling transitions (batched
per tensor role in Lightning).  None of it runs on FP8 hardware here: CPUs have
no FP8 matmul, so the emulation is for numerics (what FP8 training does to the
values, scales, saturation and underflow), never for speed.  The FP8 speed-up
exists on GPUs with FP8 tensor cores (NVIDIA Hopper/Ada/Blackwell: ``torch._scaled_mm``,
gated in ``lightning_ext.fp8``), where the matmuls run at twice the bf16 rate.
``--granularities``: Lightning also runs ``fp8-mixed`` at those FP8 granularities
(``fp8={"granularity": ...}``: current per-row / per-block / MX scales, each matmul casting its
operands along its own contraction axis, so the backward casts twice more) and prints each against
``bf16-mixed`` and against per-tensor ``fp8-mixed``.  No thresholds: figures only.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from common import (  # noqa: E402
    alternate,
    base_parser,
    fit_figures,
    machine_line,
    print_tables,
    thread_specs,
    with_controls,
    write_json,
)

from lightning_ext import MixedPrecision  # noqa: E402
from mp_callbacks.app.compare import RunSpec  # noqa: E402
from mp_callbacks.app.lightning_runner import fit_once  # noqa: E402

RECIPES = ("fp8-mixed", "bf16-mixed", "bf16-master", "32-true")
PAIRS = [("fp8-mixed", "bf16-mixed"), ("fp8-mixed", "bf16-master"), ("fp8-mixed", "32-true"),
         ("bf16-mixed", "32-true")]


def lightning_measure(recipe: str, spec: RunSpec, granularity: str | None = None):
    fp8 = {"granularity": granularity} if granularity else None

    def once() -> tuple[float, float]:
        _, recorder = fit_once(MixedPrecision(recipe, "cpu", fp8=fp8), spec)
        return fit_figures(recorder.times, recorder.cpu_times)  # median timed window: wall, CPU time
    return once


def keras_measure(recipe: str, spec: RunSpec):
    def once() -> tuple[float, float]:
        from mp_callbacks.app.keras_runner import fit_once as keras_fit_once

        _, _, recorder = keras_fit_once(recipe, spec, record=False)
        return fit_figures(recorder.times, recorder.cpu_times)
    return once


def section(title: str, variants: dict, rounds: int, prefix: str, granularities: list[str] = ()) -> dict:
    times = alternate(with_controls(variants, [f"{prefix} bf16-mixed"]), rounds)
    pairs = [(f"{prefix} {a}", f"{prefix} {b}", "none (measured)") for a, b in PAIRS]
    for g in granularities:
        pairs += [(f"{prefix} fp8-mixed/{g}", f"{prefix} {b}", "none (measured)") for b in ("bf16-mixed", "fp8-mixed")]
    return print_tables(title, times, pairs)


def main() -> None:
    parser = base_parser(__doc__, rounds=5, steps=30, batch_size=64)
    parser.add_argument("--frameworks", nargs="+", choices=["lightning", "keras"], default=["lightning", "keras"])
    parser.add_argument("--granularities", nargs="*", choices=["rowwise", "blockwise", "mxfp8"], default=[])
    parser.set_defaults(hidden=256, depth=2)
    args = parser.parse_args()
    summaries = []
    for threads, spec in thread_specs(args):
        if "lightning" not in args.frameworks:
            continue
        torch.set_num_threads(threads)
        print(machine_line(threads))
        variants = {f"lightning {r}": lightning_measure(r, spec) for r in RECIPES}
        variants.update({f"lightning fp8-mixed/{g}": lightning_measure("fp8-mixed", spec, g)
                         for g in args.granularities})
        summaries.append(section(
            f"Lightning, MLP {args.depth}x{args.hidden}, batch {args.batch_size}, {threads} thread(s), AdamW",
            variants, args.rounds, "lightning", args.granularities))
    if "keras" in args.frameworks:
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        import keras

        threads, spec = next(iter(thread_specs(args)))
        print(machine_line(threads))
        summaries.append(section(
            f"Keras ({keras.backend.backend()} backend), MLP {args.depth}x{args.hidden}, batch "
            f"{args.batch_size}, {threads} thread(s), AdamW",
            {f"keras {r}": keras_measure(r, spec) for r in RECIPES}, args.rounds, "keras"))
    write_json(args.json, summaries)


if __name__ == "__main__":
    main()
