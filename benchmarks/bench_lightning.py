"""Lightning: our plugin vs Lightning's MixedPrecision, and bf16-master vs bf16-mixed / 32-true.

    python benchmarks/bench_lightning.py [--threads 1 2] [--rounds 7] [--steps 40] [--foreach]

Prints median per-step times and median ratios (ours / native), measured in
one process, alternating, on the same MLP and batches; beside each ratio, the
control ratio of the native variant against a second copy of itself (the
noise of the machine).
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from lightning.pytorch.plugins.precision import MixedPrecision as NativeMixed  # noqa: E402
from lightning.pytorch.plugins.precision import Precision  # noqa: E402

from common import alternate, base_parser, print_table, thread_specs, with_controls  # noqa: E402
from lightning_ext import MixedPrecision  # noqa: E402
from lightning_ext.compare import fit_once  # noqa: E402
from mp_callbacks.compare import RunSpec  # noqa: E402


def measure(make_plugin, spec: RunSpec, optimizer=None):
    def once() -> float:
        _, recorder = fit_once(make_plugin(), spec, optimizer=optimizer)
        return statistics.median(recorder.timed())
    return once


def foreach_adamw(params, lr: float) -> torch.optim.Optimizer:
    """torch's multi-tensor AdamW (``foreach=True``; on CPU the default is the single-tensor loop)."""
    return torch.optim.AdamW(params, lr=lr, foreach=True)


def main() -> None:
    parser = base_parser(__doc__)
    parser.add_argument("--foreach", action="store_true",
                        help="every variant trains with AdamW(foreach=True) instead of the CPU default (single-tensor)")
    args = parser.parse_args()
    optimizer = foreach_adamw if args.foreach else None
    for threads, spec in thread_specs(args):
        torch.set_num_threads(threads)
        variants = {
            "ours 16-mixed": lambda: MixedPrecision("16-mixed", "cpu"),
            "native 16-mixed": lambda: NativeMixed("16-mixed", "cpu", torch.amp.GradScaler("cpu")),
            "ours bf16-mixed": lambda: MixedPrecision("bf16-mixed", "cpu"),
            "native bf16-mixed": lambda: NativeMixed("bf16-mixed", "cpu"),
            "ours bf16-master": lambda: MixedPrecision("bf16-master", "cpu"),
            "native 32-true": lambda: Precision(),
        }
        measured = with_controls({k: measure(v, spec, optimizer) for k, v in variants.items()},
                                 ["native 16-mixed", "native bf16-mixed", "native 32-true"])
        times = alternate(measured, args.rounds)
        print_table(
            f"Lightning, MLP {args.depth}x{args.hidden}, batch {args.batch_size}, {threads} thread(s), "
            f"AdamW {'foreach=True' if args.foreach else 'default (single-tensor on CPU)'}", times,
            [("ours 16-mixed", "native 16-mixed", "<= 1.03"),
             ("ours bf16-mixed", "native bf16-mixed", "<= 1.03"),
             ("ours bf16-master", "native bf16-mixed", "<= 1.00"),
             ("ours bf16-master", "native 32-true", "<= 0.50")],
        )


if __name__ == "__main__":
    main()
