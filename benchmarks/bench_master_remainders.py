"""Lightning ``bf16-master``: FP32 masters as bf16 weight + int16 remainder vs the FP32 copy (step time, ties).

    python benchmarks/bench_master_remainders.py [--threads 1] [--rounds 7] [--steps 40] [--json PATH]
        [--rate-steps 300] [--rate-hidden 256]

Part 1, step time: whole Trainer fits of the benchmark MLP (mp_callbacks.app.lightning_runner.fit_once,
AdamW, the CPU default implementation, which the plugin runs with torch's fused kernel), ``ours
bf16-master, remainders`` (``master_remainders=True``) against ``ours bf16-master`` (FP32 copy), run
alternately in one process, with the FP32-copy variant run twice as the control.  Medians of the
per-round ratios with their min-max, in wall and CPU time.

Part 2, how often and how much training differs: the same Fabric loop (an MLP on fixed random
regression batches, AdamW lr 1e-3) under both, from the same initial weights.  Per step it counts the
forward weights that differ from round-to-nearest-even of their master (the ties the remainder rounds
away from zero, :func:`mp_callbacks.weights.remainders.ties_differ`), and it compares the loss trajectories
and the final masters of the two runs.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
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
from lightning.fabric import Fabric  # noqa: E402
from torch import nn  # noqa: E402

from lightning_ext import MixedPrecision  # noqa: E402
from lightning_ext.fabric import MixedPrecision as FabricMixedPrecision  # noqa: E402
from mp_callbacks.app.compare import RunSpec  # noqa: E402
from mp_callbacks.app.lightning_runner import fit_once  # noqa: E402
from mp_callbacks.weights import ties_differ  # noqa: E402

COPY, REM = "ours bf16-master (FP32 copy)", "ours bf16-master, remainders"


def measure(remainders: bool, spec: RunSpec):
    def once() -> tuple[float, float]:
        _, recorder = fit_once(MixedPrecision("bf16-master", "cpu", master_remainders=remainders), spec)
        return fit_figures(recorder.times, recorder.cpu_times)
    return once


def training_difference(steps: int, hidden: int, depth: int = 3, batch: int = 256) -> dict[str, float]:
    """Part 2: tie counts of the remainder run, and how far its losses and masters drift from the copy run."""
    gen = torch.Generator().manual_seed(0)
    data = [(torch.randn(batch, 64, generator=gen), torch.randn(batch, 1, generator=gen)) for _ in range(16)]
    out: dict[str, list] = {}
    masters = {}
    for remainders in (False, True):
        torch.manual_seed(0)
        layers: list[nn.Module] = [nn.Linear(64, hidden), nn.GELU()]
        for _ in range(depth - 1):
            layers += [nn.Linear(hidden, hidden), nn.GELU()]
        model = nn.Sequential(*layers, nn.Linear(hidden, 1))
        plugin = FabricMixedPrecision("bf16-master", master_remainders=remainders)
        fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
        model, opt = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
        losses, ties, elements = [], 0, 0
        for step in range(steps):
            x, y = data[step % len(data)]
            loss = F.mse_loss(model(x), y)
            losses.append(float(loss.detach()))
            fabric.backward(loss)
            opt.step()
            opt.zero_grad()
            if remainders:
                for entry in plugin.masters.entries():
                    ties += int(ties_differ(plugin.masters.value(entry).numpy()).sum())
                    elements += entry.master.numel()
        out[remainders] = losses
        masters[remainders] = plugin.master_state_dict()
        if remainders:
            tie_rate = ties / elements
    a, b = np.array(out[False]), np.array(out[True])
    first = int(np.argmax(a != b)) if np.any(a != b) else steps
    rel = np.abs(b - a) / np.abs(a)
    master_rel = max(float((masters[True][k] - masters[False][k]).norm() / masters[False][k].norm())
                     for k in masters[False])
    return {"steps": steps, "hidden": hidden, "depth": depth, "weights_per_step": elements / steps,
            "tie_rate_per_weight_step": tie_rate, "ties_total": ties, "first_step_losses_differ": first,
            "loss_rel_diff_median": float(np.median(rel)), "loss_rel_diff_max": float(rel.max()),
            "final_loss_copy": float(a[-16:].mean()), "final_loss_remainders": float(b[-16:].mean()),
            "final_master_rel_diff_max": master_rel}


def main() -> None:
    parser = base_parser(__doc__)
    parser.add_argument("--rate-steps", type=int, default=300)
    parser.add_argument("--rate-hidden", type=int, default=256)
    parser.set_defaults(threads=[1])
    args = parser.parse_args()
    summaries = []
    for threads, spec in thread_specs(args):
        torch.set_num_threads(threads)
        print(machine_line(threads))
        measured = with_controls({REM: measure(True, spec), COPY: measure(False, spec)}, [COPY])
        times = alternate(measured, args.rounds)
        summaries.append(print_tables(
            f"Lightning bf16-master, MLP {args.depth}x{args.hidden}, batch {args.batch_size}, {threads} thread(s), "
            "AdamW (fused step)", times, [(REM, COPY, "< 1.05 to be the default")]))
    diff = training_difference(args.rate_steps, args.rate_hidden)
    print("\nhow often and how much training differs (remainders vs FP32 copy):")
    for k, v in diff.items():
        print(f"  {k:<28} {v:.6g}" if isinstance(v, float) else f"  {k:<28} {v}")
    write_json(args.json, {"step_time": summaries, "training_difference": diff})


if __name__ == "__main__":
    main()
