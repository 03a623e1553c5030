"""bf16-kahan and bf16-sr against their peers: torch-optimi's Kahan AdamW and torchao's stochastically rounded AdamW.

    python benchmarks/bench_rounding_peers.py [--threads 1] [--rounds 5] [--steps 10] [--batch-size 16]
                                              [--hidden 1024] [--depth 3] [--parts step whole] [--no-torchao]

On the benchmark MLP (``mp_callbacks.app.lightning_runner.mlp``, 3x1024: 3.2 M parameters) held in bf16,
AdamW (lr 1e-3, weight decay 1e-2), the variants run alternately in one process (``common.alternate``: order
reversed every other round), each on its own copy of the model:

* ``ours bf16-kahan`` / ``ours bf16-sr``: ``lightning_ext.rounding.UpdateRounding`` (what the plugin's
  weight store runs at ``optimizer.step()``) around ``torch.optim.AdamW``, FP32 optimizer states (the recipes'
  default: 14 and 12 B/param); ``..., bf16 states``: ``state_dtype="bfloat16"`` (10 and 8 B/param);
* ``optimi AdamW(kahan_sum=True)``: torch-optimi's AdamW on the bf16 parameters (bf16 states and compensation,
  its foreach implementation: 10 B/param);
* ``torchao _AdamW(bf16_stochastic_round=True)``: torchao's AdamW on the bf16 parameters (bf16 states, one
  ``torch.compile``'d update per parameter, compiled in the warm-up: 8 B/param).

Two parts (``--parts``): ``step``, the optimizer step alone (the bf16 gradients given, set before each step);
``whole``, forward + backward + step on a batch of ``--batch-size`` (the model in bf16; the forward and
backward are the same for every variant).  Each peer also runs a second time as a control (the machine's
noise); ratios are ours / peer, median of the per-round ratios with their min-max, in CPU and in wall time.
Also printed: the minor page faults per step of each variant (``getrusage``) and the CPU model (``lscpu``).
No thresholds: figures only.
"""

from __future__ import annotations

import resource
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from common import alternate, base_parser, machine_line, print_tables, with_controls, write_json  # noqa: E402
from torch import nn  # noqa: E402

from lightning_ext.rounding import UpdateRounding  # noqa: E402
from mp_callbacks.app.lightning_runner import mlp  # noqa: E402
from mp_callbacks.recipes import get_recipe  # noqa: E402

LR, WD = 1e-3, 1e-2
OPTIMI = "optimi AdamW(kahan_sum=True)"
TORCHAO = "torchao _AdamW(bf16_stochastic_round=True)"


def lscpu_model() -> str:
    """The ``Model name`` line of ``lscpu`` (empty when lscpu is missing)."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
    except OSError:
        return ""
    return next((line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")), "")


class Setup:
    """One variant's model (bf16), optimizer, fixed gradients and batch, and its step."""

    def __init__(self, kind: str, hidden: int, depth: int, batch: int) -> None:
        torch.manual_seed(0)
        net = mlp(hidden, depth)
        originals = {n: p.detach().clone() for n, p in net.named_parameters()}
        self.net = net.to(torch.bfloat16)
        self.params = list(net.parameters())
        self.grads = [(torch.randn(p.shape) * 1e-2).to(torch.bfloat16) for p in self.params]
        self.x = torch.randn(batch, 64).to(torch.bfloat16)
        self.y = torch.randint(0, 10, (batch,))
        self.store = None
        if kind.startswith("ours"):
            recipe = "bf16-kahan" if "kahan" in kind else "bf16-sr"
            states = "bfloat16" if "bf16 states" in kind else "float32"
            self.store = UpdateRounding(get_recipe(recipe, state_dtype=states).master, seed=0)
            self.store.record_originals(net, originals)
            self.opt = torch.optim.AdamW(self.params, lr=LR, weight_decay=WD)
            self.store.install(net, [self.opt])
        elif kind == OPTIMI:
            import optimi

            self.opt = optimi.AdamW(self.params, lr=LR, weight_decay=WD, kahan_sum=True)
        else:
            from torchao.optim import _AdamW

            self.opt = _AdamW(self.params, lr=LR, weight_decay=WD, bf16_stochastic_round=True)

    def step(self) -> None:
        if self.store is not None:
            self.store.step(self.opt)
        else:
            self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def step_alone(self) -> None:
        for p, g in zip(self.params, self.grads):
            p.grad = g.clone() if self.store is None else g  # the peers may write into their gradients
        self.step()

    def whole(self) -> None:
        loss = nn.functional.cross_entropy(self.net(self.x).float(), self.y)
        loss.backward()
        self.step()


def variant(setup: Setup, body: Callable[[], None], steps: int, faults: dict, name: str):
    """(wall, CPU) seconds per step of ``steps`` calls of ``body``; records minor page faults per step."""
    def once() -> tuple[float, float]:
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(steps):
            body()
        wall, cpu = (time.perf_counter() - t0) / steps, (time.process_time() - c0) / steps
        faults.setdefault(name, []).append((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0) / steps)
        return wall, cpu
    return once


def main() -> None:
    parser = base_parser(__doc__, rounds=5, steps=10, batch_size=16)
    parser.set_defaults(threads=[1])
    parser.add_argument("--parts", nargs="+", choices=["step", "whole"], default=["step", "whole"])
    parser.add_argument("--no-torchao", action="store_true",
                        help="leave out torchao (its compile needs a C++ compiler)")
    args = parser.parse_args()
    kinds = ["ours bf16-kahan", "ours bf16-kahan, bf16 states", OPTIMI]
    if not args.no_torchao:
        kinds += ["ours bf16-sr", "ours bf16-sr, bf16 states", TORCHAO]
    pairs = [(k, OPTIMI, "<= 1 (issue #27)") for k in kinds if "kahan" in k and k != OPTIMI]
    pairs += [(k, TORCHAO, "<= 1 (issue #27)") for k in kinds if "sr" in k and k.startswith("ours")]
    summaries = []
    print(f"lscpu model name: {lscpu_model() or 'unknown'}")
    for threads in args.threads:
        torch.set_num_threads(threads)
        print(machine_line(threads))
        for part in args.parts:
            setups = {k: Setup(k, args.hidden, args.depth, args.batch_size) for k in kinds}
            n = sum(p.numel() for p in setups[kinds[0]].params)
            faults: dict = {}
            variants = {}
            for k, s in setups.items():
                body = s.step_alone if part == "step" else s.whole
                for _ in range(2):  # warm-up: state creation, torchao's compile
                    body()
                variants[k] = variant(s, body, args.steps, faults, k)
            peers = [p for p in (OPTIMI, TORCHAO) if p in variants]
            times = alternate(with_controls(variants, peers), args.rounds)
            what = ("optimizer step alone" if part == "step"
                    else f"whole step (forward + backward, batch {args.batch_size})")
            data = print_tables(f"{what}, MLP {args.depth}x{args.hidden} ({n} parameters, bf16), AdamW, "
                                f"{threads} thread(s), {args.steps} steps per measurement", times, pairs)
            per_step = {k: sorted(v)[len(v) // 2] for k, v in faults.items()}
            print("  minor page faults per step (median over rounds): "
                  + ", ".join(f"{k} {v:.0f}" for k, v in per_step.items() if "(control)" not in k))
            summaries.append({"part": part, "threads": threads, "params": n, "clocks": data, "faults": per_step})
    write_json(args.json, summaries)


if __name__ == "__main__":
    main()
