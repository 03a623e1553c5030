"""The cost of restoring the forward's buffers on skipped steps (``restore_forward_state``), Fabric loop.

    python benchmarks/bench_forward_state.py [--threads 1] [--rounds 7] [--steps 30] [--batch-size 32]
                                             [--recipe bf16-master]

A small convolutional net with BatchNorm after every convolution (the buffers a step keeps: running
mean, variance and the batch counter of each) trains under ``lightning_ext.FabricMixedPrecision``
with the restore on (the default: a copy of every training-mode buffer at each step's first forward)
and off, alternating in one process, with a control copy of "off"; prints the step time per
variant and the ratio on/off (wall and CPU time, min-max over rounds), the bytes kept and the
CPU model.  No step is skipped: this is the price of being ready to.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from common import alternate, base_parser, machine_line, per_step, print_tables, with_controls  # noqa: E402
from lightning.fabric import Fabric  # noqa: E402
from torch import nn  # noqa: E402

from lightning_ext import FabricMixedPrecision  # noqa: E402


def conv_bn(width: int = 32, blocks: int = 4) -> nn.Module:
    layers: list[nn.Module] = [nn.Conv2d(3, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU()]
    for _ in range(blocks - 1):
        layers += [nn.Conv2d(width, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU()]
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(width, 10))


def variant(recipe: str, restore: bool, steps: int, batch: int):
    torch.manual_seed(0)
    plugin = FabricMixedPrecision(recipe, restore_forward_state=restore)
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    net = conv_bn()
    model, opt = fabric.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-3))
    x, y = torch.randn(batch, 3, 16, 16), torch.randint(0, 10, (batch,))

    def step() -> None:
        fabric.backward(F.cross_entropy(model(x).float(), y))
        opt.step()
        opt.zero_grad()

    step()  # warm-up: builds the masters and the kept copies
    return per_step(step, steps), plugin


def main() -> None:
    parser = base_parser(__doc__, rounds=7, steps=30, batch_size=32)
    parser.add_argument("--recipe", default="bf16-master")
    args = parser.parse_args()
    threads = args.threads[0]
    torch.set_num_threads(threads)
    print(machine_line(threads))
    on, plugin = variant(args.recipe, True, args.steps, args.batch_size)
    off, _ = variant(args.recipe, False, args.steps, args.batch_size)
    times = alternate(with_controls({"restore on": on, "restore off": off}, ["restore off"]), args.rounds)
    print(f"kept per step: {plugin.forward_state.kept_bytes} bytes "
          f"({sum(p.numel() for p in conv_bn().parameters())} parameters)")
    print_tables(f"Fabric, {args.recipe}, conv+BatchNorm x4 (32 ch, 16x16), batch {args.batch_size}, "
                 f"{threads} thread(s)", times, [("restore on", "restore off", "<= 1.02")])


if __name__ == "__main__":
    main()
