"""How do our bf16 update rules compare with their peers: how close to an FP32 run after N steps, how fast?

    python benchmarks/update_rules.py [--rounds 7] [--steps 30] [--warmup 3] [--lr 1e-3] [--hidden 512]
        [--depth 2] [--batch-size 64] [--only TEXT ...] [--no-torchao] [--threads 1] [--json PATH]

Every variant trains the same MLP (``torch_models.mlp``, from the same initial weights) on the same batches of
scikit-learn's digits with AdamW (``--lr``, weight decay 1e-2):

* ``fp32``: the model in FP32, torch's AdamW: the reference every other variant's result is compared with;
* ours, through ``Fabric(plugins=[lightning_ext.FabricMixedPrecision(recipe)])`` around torch's AdamW:
  ``bf16-master`` (FP32 masters), ``bf16-kahan`` (bf16 weights + a bf16 compensation buffer), ``bf16-sr``
  (stochastic rounding), and ``bf16-master`` with ``state_dtype="8bit"``;
* their peers, on the model cast to bf16, in a plain loop: torch-optimi's ``AdamW(kahan_sum=True)`` (for
  ``bf16-kahan``), torchao's ``_AdamW(bf16_stochastic_round=True)`` (for ``bf16-sr``; one ``torch.compile``'d update
  per parameter, compiled during the warm-up), and, for the 8-bit states, torchao's ``AdamW8bit`` on the FP32
  model under ``torch.autocast(bfloat16)`` (what a user of native ``bf16-mixed`` would write).

The variants alternate (``harness.py``); the timing table gives ours / peer (and the peers' controls).  After the
run (``warmup + rounds x steps`` steps each) every model is scored in FP32 as it stands (its bf16 weights where it
keeps them): the loss over the whole digits set, its difference from ``fp32``'s, the accuracy, and the relative
L2 distance of its weights from ``fp32``'s.  ``--no-torchao``: without torchao's variants (its compile needs a C++
compiler).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness  # noqa: E402

WD = 1e-2
OPTIMI = "optimi AdamW(kahan_sum=True)"
TORCHAO_SR = "torchao _AdamW(bf16_stochastic_round=True)"
TORCHAO_8BIT = "torchao AdamW8bit, bf16 autocast"
OURS = {"ours bf16-master": ("bf16-master", {}), "ours bf16-kahan": ("bf16-kahan", {}),
        "ours bf16-sr": ("bf16-sr", {}), "ours bf16-master, state_dtype=8bit": ("bf16-master", {"state_dtype": "8bit"})}
PAIRS = [("ours bf16-kahan", OPTIMI), ("ours bf16-sr", TORCHAO_SR),
         ("ours bf16-master, state_dtype=8bit", TORCHAO_8BIT), ("ours bf16-master", "fp32"),
         ("ours bf16-kahan", "ours bf16-master"), ("ours bf16-sr", "ours bf16-master")]
PEERS = ["fp32", OPTIMI, TORCHAO_SR, TORCHAO_8BIT]


def variants(args: Any, batches: list, nets: dict[str, Any]) -> dict[str, harness.Build]:
    """``{name: build}``; each build keeps its module in ``nets[name]`` (the last built of a name: a peer's control,
    trained exactly as the peer)."""
    import torch
    import torch.nn.functional as F
    import torch_models as tm

    from lightning_ext import FabricMixedPrecision

    def fresh(name: str) -> torch.nn.Module:
        net = nets[name] = tm.mlp(args.hidden, args.depth)
        return net

    def ours(name: str, recipe: str, options: dict) -> harness.Build:
        def build(clock: harness.Clock) -> Callable[[], None]:
            from lightning.fabric import Fabric

            fabric = Fabric(accelerator="cpu", devices=1, plugins=[FabricMixedPrecision(recipe, **options)])
            net = fresh(name)
            model, opt = fabric.setup(net, torch.optim.AdamW(net.parameters(), lr=args.lr, weight_decay=WD))
            it = iter(batches * (clock.total // len(batches) + 1))

            def step() -> None:
                x, y = next(it)
                fabric.backward(F.cross_entropy(model(x).float(), y))
                opt.step()
                opt.zero_grad(set_to_none=True)
            return harness.loop(clock, step)
        return build

    def peer(name: str) -> harness.Build:
        def build(clock: harness.Clock) -> Callable[[], None]:
            net = fresh(name)
            autocast = name == TORCHAO_8BIT
            if name not in ("fp32", TORCHAO_8BIT):
                net.to(torch.bfloat16)
            if name == OPTIMI:
                import optimi

                opt = optimi.AdamW(net.parameters(), lr=args.lr, weight_decay=WD, kahan_sum=True)
            elif name == TORCHAO_SR:
                from torchao.optim import _AdamW

                opt = _AdamW(net.parameters(), lr=args.lr, weight_decay=WD, bf16_stochastic_round=True)
            elif name == TORCHAO_8BIT:
                from torchao.optim import AdamW8bit

                opt = AdamW8bit(net.parameters(), lr=args.lr, weight_decay=WD)
            else:
                opt = torch.optim.AdamW(net.parameters(), lr=args.lr, weight_decay=WD)
            it = iter(batches * (clock.total // len(batches) + 1))
            dtype = torch.bfloat16 if name not in ("fp32", TORCHAO_8BIT) else torch.float32

            def step() -> None:
                x, y = next(it)
                with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
                    out = net(x.to(dtype))
                F.cross_entropy(out.float(), y).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            return harness.loop(clock, step)
        return build

    out: dict[str, harness.Build] = {"fp32": peer("fp32")}
    for name, (recipe, options) in OURS.items():
        out[name] = ours(name, recipe, options)
    out[OPTIMI] = peer(OPTIMI)
    if not args.no_torchao:
        out[TORCHAO_SR] = peer(TORCHAO_SR)
        out[TORCHAO_8BIT] = peer(TORCHAO_8BIT)
    return out


def scores(nets: dict[str, Any], data: tuple) -> dict[str, dict[str, float]]:
    """Per variant: FP32 loss over ``data`` of its module as it stands, and its weights' distance from fp32's."""
    import torch
    import torch.nn.functional as F

    x, y = data
    ref = {k: v.detach().float() for k, v in nets["fp32"].state_dict().items()}
    out = {}
    with torch.no_grad():
        for name, net in nets.items():
            weights = {k: v.detach().float() for k, v in net.state_dict().items()}
            h = x
            for layer in net:
                if isinstance(layer, torch.nn.Linear):
                    h = F.linear(h, layer.weight.float(), layer.bias.float())
                else:
                    h = layer(h)
            num = sum(float((weights[k] - ref[k]).square().sum()) for k in ref)
            den = sum(float(ref[k].square().sum()) for k in ref)
            out[name] = {"loss": float(F.cross_entropy(h, y)), "accuracy": float((h.argmax(-1) == y).float().mean()),
                         "weights_rel_l2": (num / den) ** 0.5}
    base = out["fp32"]["loss"]
    for s in out.values():
        s["loss_vs_fp32"] = s["loss"] - base
    return out


def main(argv: list[str] | None = None) -> dict:
    p = harness.parser(__doc__, rounds=7, steps=30, warmup=3)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--depth", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--only", nargs="+", default=None, metavar="TEXT", help="the variants whose name has a TEXT")
    p.add_argument("--no-torchao", action="store_true")
    args = p.parse_args(argv)
    harness.quiet()
    harness.setup(args)
    import torch_models as tm

    total = args.warmup + args.rounds * args.steps
    batches, data = tm.digits(min(total, 256), args.batch_size)
    nets: dict[str, Any] = {}
    built = variants(args, batches, nets)
    if args.only:
        built = {k: v for k, v in built.items() if k == "fp32" or any(t in k for t in args.only)}
    times = harness.run_rounds(harness.with_controls(built, [n for n in PEERS if n in built]), args.rounds,
                               args.steps, args.warmup)
    summary = harness.summarize(times, PAIRS)
    graded = scores(nets, data)
    print(harness.machine_line(args.threads))
    print(harness.markdown(f"MLP 64-{'-'.join([str(args.hidden)] * args.depth)}-10 on digits, batch "
                           f"{args.batch_size}, AdamW lr {args.lr}, whole training step; {args.rounds} rounds x "
                           f"{args.steps} steps", summary))
    print(f"### After {total} steps: the model as it stands, scored in FP32 on the whole digits set\n")
    print("| variant | loss | loss - fp32's | accuracy | weights' relative L2 distance from fp32's |\n"
          "|---|---|---|---|---|")
    for name, s in graded.items():
        print(f"| {name} | {s['loss']:.5f} | {s['loss_vs_fp32']:+.5f} | {s['accuracy']:.4f} | "
              f"{s['weights_rel_l2']:.2e} |")
    result = {"timing": summary, "scores": graded, "steps": total}
    harness.write_json(args.json, result, args.threads)
    return result


if __name__ == "__main__":
    main()
