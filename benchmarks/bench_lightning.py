"""Lightning: our plugin vs Lightning's MixedPrecision, and bf16-master vs bf16-mixed / 32-true.

    python benchmarks/bench_lightning.py [--threads 1 2] [--rounds 7] [--steps 40] [--foreach] [--no-fp16]
        [--batch-size 512] [--json PATH]

Prints median per-step times and median ratios (ours / native), measured in
one process, alternating, on the same MLP and batches; beside each ratio, the
control ratio of the native variant against a second copy of itself (the
noise of the machine).  A fit's figure is the median of its timed windows
(:func:`mp_callbacks.app.measurement.step_timing`), in wall time and in this process's
CPU time (robust to other jobs on a shared machine); spreads are min-max over
rounds.
bf16-master runs its masters' step with torch's fused kernel
(``lightning_ext.fused_step``); two references show where its time goes:
native bf16-mixed with ``AdamW(fused=True)`` and ours with torch's default
step (``fused_step=False``).
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
    fit_figures,
    machine_line,
    print_tables,
    thread_specs,
    with_controls,
    write_json,
)
from lightning.pytorch.plugins.precision import MixedPrecision as NativeMixed  # noqa: E402
from lightning.pytorch.plugins.precision import Precision  # noqa: E402

from lightning_ext import MixedPrecision  # noqa: E402
from mp_callbacks.app.compare import RunSpec  # noqa: E402
from mp_callbacks.app.lightning_runner import fit_once  # noqa: E402


def measure(make_plugin, spec: RunSpec, optimizer=None):
    def once() -> tuple[float, float]:
        _, recorder = fit_once(make_plugin(), spec, optimizer=optimizer)
        return fit_figures(recorder.times, recorder.cpu_times)  # median timed window: wall, CPU time
    return once


def fused_adamw(params, lr: float) -> torch.optim.Optimizer:
    """``AdamW(fused=True)``: torch's fused kernel, what the bf16-master step uses on its masters."""
    return torch.optim.AdamW(params, lr=lr, fused=True)


def unfused_master() -> MixedPrecision:
    plugin = MixedPrecision("bf16-master", "cpu")
    plugin.masters.fused_step = False
    return plugin


def foreach_adamw(params, lr: float) -> torch.optim.Optimizer:
    """torch's multi-tensor AdamW (``foreach=True``; on CPU the default is the single-tensor loop)."""
    return torch.optim.AdamW(params, lr=lr, foreach=True)


def main() -> None:
    parser = base_parser(__doc__)
    parser.add_argument("--foreach", action="store_true",
                        help="every variant trains with AdamW(foreach=True) instead of the CPU default (single-tensor)")
    parser.add_argument("--no-fp16", action="store_true",
                        help="leave out the 16-mixed variants (float16 matmuls are very slow on CPUs without AMX-FP16)")
    args = parser.parse_args()
    optimizer = foreach_adamw if args.foreach else None
    summaries = []
    for threads, spec in thread_specs(args):
        torch.set_num_threads(threads)
        print(machine_line(threads))
        variants = {
            "ours 16-mixed": (lambda: MixedPrecision("16-mixed", "cpu"), optimizer),
            "native 16-mixed": (lambda: NativeMixed("16-mixed", "cpu", torch.amp.GradScaler("cpu")), optimizer),
            "ours bf16-mixed": (lambda: MixedPrecision("bf16-mixed", "cpu"), optimizer),
            "native bf16-mixed": (lambda: NativeMixed("bf16-mixed", "cpu"), optimizer),
            "ours bf16-master": (lambda: MixedPrecision("bf16-master", "cpu"), optimizer),
            "ours bf16-master, torch's default step": (unfused_master, optimizer),
            "native bf16-mixed, AdamW(fused=True)": (lambda: NativeMixed("bf16-mixed", "cpu"), fused_adamw),
            "native 32-true": (lambda: Precision(), optimizer),
        }
        if args.no_fp16:
            variants = {k: v for k, v in variants.items() if "16-mixed" not in k or "bf16" in k}
        natives = [n for n in ("native 16-mixed", "native bf16-mixed", "native 32-true") if n in variants]
        measured = with_controls({k: measure(make, spec, opt) for k, (make, opt) in variants.items()}, natives)
        times = alternate(measured, args.rounds)
        pairs = [("ours 16-mixed", "native 16-mixed", "<= 1.03"),
                 ("ours bf16-mixed", "native bf16-mixed", "<= 1.03"),
                 ("ours bf16-master", "native bf16-mixed", "<= 0.95"),
                 ("ours bf16-master", "native bf16-mixed, AdamW(fused=True)", "reference"),
                 ("ours bf16-master", "ours bf16-master, torch's default step", "the fused step's gain"),
                 ("ours bf16-master", "native 32-true", "<= 0.50")]
        summaries.append(print_tables(
            f"Lightning, MLP {args.depth}x{args.hidden}, batch {args.batch_size}, {threads} thread(s), "
            f"AdamW {'foreach=True' if args.foreach else 'default (single-tensor on CPU)'}", times,
            [p for p in pairs if p[0] in variants and p[1] in variants]))
    write_json(args.json, summaries)


if __name__ == "__main__":
    main()
