"""The ``*-master`` optimizer step alone: ways to update FP32 masters from bf16 gradients, against native.

    python benchmarks/bench_lightning_fused_step.py [--threads 1] [--rounds 9] [--steps 20] [--model mlp transformer]

Per optimizer step (forward/backward left out), on the parameters of the
benchmark MLP (3x1024, bench_lightning.py) or of the transformer
(bench_transformer_model.py), AdamW lr 1e-3, the gradients already there:

* ``native bf16-mixed``: what Lightning's bf16-mixed steps: AdamW on the FP32
  parameters and FP32 gradients, torch's default implementation (the
  single-tensor loop on CPU);
* ``native bf16-mixed, fused=True``: the same with ``AdamW(fused=True)``;
* ``ours *-mixed, one pass``: native bf16-mixed's step as ours runs it under ``32-true``/``*-mixed``
  (``lightning_ext.adam_native.single_tensor_pass``: torch's single-tensor loop answered by one native
  pass per parameter, the same bits);
* ``ours bf16-master``: ``MasterWeights``: bf16 grads -> FP32 master grads, the
  user's AdamW on the masters with the fused kernel
  (``lightning_ext.fused_step``), masters -> bf16 weights (the weights'
  storage released during the step: 16 B/param held);
* ``ours bf16-master, torch's default step``: the same with ``fused_step=False``;
* ``ours bf16-master, one pass``: the plugin's one-pass step (``collect_grads(one_pass=True)``:
  the masters hold the bf16 gradients, the fused kernel's call runs ``lightning_ext.master_native``'s
  loop, which also writes the bf16 weights; the weights kept: 16 B/param), the check left out as above;
* ``single pass, eager chunks (prototype)``: per 2**17-element chunk, the bf16
  gradient into an FP32 scratch buffer, torch's fused AdamW kernel on the chunk,
  the chunk back into the bf16 weight (in cache between the three; no FP32
  gradient, no weight released: 16 B/param, no page faults);
* ``gradient copy alone``: ``MasterWeights.grads_to_masters`` (one ``to(float32)`` per parameter), the
  master gradients dropped after it as after a step; and ``gradient copy into one buffer (prototype)``:
  one FP32 buffer per step, the master gradients its views, one ``_foreach_copy_`` (no per-parameter cast);
* ``compiled single pass``: a ``torch.compile``'d AdamW update that reads the
  bf16 gradient and writes master, m, v and the bf16 weight in one loop (no
  FP32 gradient at all; 16 B/param without releasing the weights).  Its first
  call compiles (printed; needs a C++ compiler).

The forward and backward passes differ too (native casts the FP32 weights to
bf16 in every forward and the bf16 weight gradients to FP32 in every backward;
ours does neither): bench_lightning.py and bench_transformer.py time whole steps.
"""

from __future__ import annotations

import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from bench_transformer_model import GPTConfig, TinyGPT  # noqa: E402
from common import (  # noqa: E402
    alternate,
    base_parser,
    by_clock,
    machine_line,
    per_step,
    print_tables,
    with_controls,
    write_json,
)
from torch import nn  # noqa: E402

from lightning_ext.adam_native import single_tensor_pass  # noqa: E402
from lightning_ext.masters import MasterWeights  # noqa: E402
from mp_callbacks.app.lightning_runner import mlp  # noqa: E402

LR, BETA1, BETA2, EPS, WD = 1e-3, 0.9, 0.999, 1e-8, 1e-2


def model(name: str) -> nn.Module:
    torch.manual_seed(0)
    if name == "mlp":
        return mlp(1024, 3)
    return TinyGPT(GPTConfig())


def native(name: str, steps: int, fused: bool, one_pass: bool = False) -> Callable[[], tuple[float, float]]:
    net = model(name)
    params = list(net.parameters())
    grads = [torch.randn_like(p) * 1e-2 for p in params]
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=WD, fused=True if fused else None)

    def one_step() -> None:
        for p, g in zip(params, grads):
            p.grad = g
        if one_pass:
            with single_tensor_pass(opt):
                opt.step()
        else:
            opt.step()
    return per_step(one_step, steps)


def masters(name: str, steps: int, fused_step: bool, one_pass: bool = False) -> Callable[[], tuple[float, float]]:
    net = model(name)
    originals = {n: p.detach().clone() for n, p in net.named_parameters()}
    net.to(torch.bfloat16)
    mw = MasterWeights(fused_step=fused_step)
    mw.record_originals(net, originals)
    opt = torch.optim.AdamW(net.parameters(), lr=LR, weight_decay=WD)
    mw.install(net, [opt])
    lows = list(net.parameters())
    grads = [(torch.randn(p.shape) * 1e-2).to(torch.bfloat16) for p in lows]
    entries = mw.for_optimizer(opt)

    def one_step() -> None:
        for p, g in zip(lows, grads):
            p.grad = g
        with torch.no_grad():
            if one_pass:
                mw.collect_grads(opt, one_pass=True)
            else:
                mw.grads_to_masters(entries)
        with mw.updating(opt):
            opt.step()
    return per_step(one_step, steps)


def grad_copy(name: str, steps: int, one_buffer: bool) -> Callable[[], tuple[float, float]]:
    """The bf16 -> FP32 master gradient copy alone, the master gradients dropped after it (as after a step)."""
    net = model(name)
    originals = {n: p.detach().clone() for n, p in net.named_parameters()}
    net.to(torch.bfloat16)
    mw = MasterWeights()
    mw.record_originals(net, originals)
    opt = torch.optim.AdamW(net.parameters(), lr=LR, weight_decay=WD)
    mw.install(net, [opt])
    lows = list(net.parameters())
    grads = [(torch.randn(p.shape) * 1e-2).to(torch.bfloat16) for p in lows]
    entries = mw.for_optimizer(opt)
    masters_ = [e.master for e in entries]
    sizes = [m.numel() for m in masters_]

    def one_step() -> None:
        for p, g in zip(lows, grads):
            p.grad = g
        with torch.no_grad():
            if one_buffer:
                views = [piece.view(m.shape) for m, piece in zip(masters_, torch.empty(sum(sizes)).split(sizes))]
                for m, v, p in zip(masters_, views, lows):
                    m.grad = v
                    p.grad = None
                torch._foreach_copy_(views, grads)
            else:
                mw.grads_to_masters(entries)
        for m in masters_:
            m.grad = None
    return per_step(one_step, steps)


def compiled(name: str, steps: int, report: dict) -> Callable[[], tuple[float, float]]:
    net = model(name)
    masters_ = [p.detach().clone() for p in net.parameters()]
    lows = [m.to(torch.bfloat16) for m in masters_]
    grads = [(torch.randn(m.shape) * 1e-2).to(torch.bfloat16) for m in masters_]
    ms = [torch.zeros_like(m) for m in masters_]
    vs = [torch.zeros_like(m) for m in masters_]

    @torch.compile(dynamic=True, fullgraph=True)
    def update(g, p, m, v, low, lr, wd, bc1, bc2_sqrt):  # noqa: ANN001
        g = g.float()
        p.mul_(1 - lr * wd)
        m.lerp_(g, 1 - BETA1)
        v.mul_(BETA2).addcmul_(g, g, value=1 - BETA2)
        p.sub_(lr / bc1 * m / (v.sqrt() / bc2_sqrt + EPS))
        low.copy_(p)

    step = [0]

    def one_step() -> None:
        step[0] += 1
        t = step[0]
        scalars = [torch.tensor(x) for x in (LR, WD, 1 - BETA1 ** t, math.sqrt(1 - BETA2 ** t))]
        for args in zip(grads, masters_, ms, vs, lows):
            update(*args, *scalars)

    t0 = time.perf_counter()
    one_step()
    report["compile_s"] = time.perf_counter() - t0
    print(f"  (compiled single pass: first call, compile included, {report['compile_s']:.1f} s)")

    return per_step(one_step, steps)


def chunked(name: str, steps: int, chunk: int = 1 << 17) -> Callable[[], tuple[float, float]]:
    """A prototype of the single pass in eager mode: per chunk of ``chunk`` elements, the bf16 gradient into an
    FP32 scratch buffer, torch's fused AdamW on the chunk of master, m and v, the chunk back into the bf16
    weight; the chunk stays in cache between the three.  No FP32 gradient, no weight released: 16 B/param."""
    net = model(name)
    masters_ = [p.detach().clone().reshape(-1) for p in net.parameters()]
    lows = [m.to(torch.bfloat16) for m in masters_]
    grads = [(torch.randn(m.shape) * 1e-2).to(torch.bfloat16) for m in masters_]
    ms = [torch.zeros_like(m) for m in masters_]
    vs = [torch.zeros_like(m) for m in masters_]
    scratch = torch.empty(chunk)
    step_t = torch.zeros(())

    def one_step() -> None:
        step_t.add_(1)
        for g, p, m, v, low in zip(grads, masters_, ms, vs, lows):
            for a in range(0, p.numel(), chunk):
                b = min(a + chunk, p.numel())
                g32 = scratch[: b - a]
                g32.copy_(g[a:b])
                torch._fused_adamw_([p[a:b]], [g32], [m[a:b]], [v[a:b]], [], [step_t], lr=LR, beta1=BETA1,
                                    beta2=BETA2, weight_decay=WD, eps=EPS, amsgrad=False, maximize=False)
                low[a:b].copy_(p[a:b])

    return per_step(one_step, steps)


def main() -> None:
    parser = base_parser(__doc__, rounds=9, steps=20)
    parser.set_defaults(threads=[1])
    parser.add_argument("--model", nargs="+", choices=["mlp", "transformer"], default=["mlp", "transformer"])
    parser.add_argument("--no-compile", action="store_true", help="leave out the torch.compile'd variant")
    args = parser.parse_args()
    summaries = []
    for threads in args.threads:
        torch.set_num_threads(threads)
        print(machine_line(threads))
        for name in args.model:
            n = sum(p.numel() for p in model(name).parameters())
            report: dict = {}
            variants = {
                "native bf16-mixed": native(name, args.steps, fused=False),
                "native bf16-mixed, fused=True": native(name, args.steps, fused=True),
                "ours *-mixed, one pass": native(name, args.steps, fused=False, one_pass=True),
                "ours bf16-master": masters(name, args.steps, fused_step=True),
                "ours bf16-master, torch's default step": masters(name, args.steps, fused_step=False),
                "ours bf16-master, one pass": masters(name, args.steps, fused_step=True, one_pass=True),
            }
            variants["single pass, eager chunks (prototype)"] = chunked(name, args.steps)
            variants["gradient copy alone"] = grad_copy(name, args.steps, one_buffer=False)
            variants["gradient copy into one buffer (prototype)"] = grad_copy(name, args.steps, one_buffer=True)
            if not args.no_compile:
                variants["compiled single pass"] = compiled(name, args.steps, report)
            times = alternate(with_controls(variants, ["native bf16-mixed"]), args.rounds)
            pairs = [("ours *-mixed, one pass", "native bf16-mixed", "torch's loop in one pass"),
                     ("ours *-mixed, one pass", "native bf16-mixed, fused=True", "reference"),
                     ("ours bf16-master", "native bf16-mixed", "optimizer step"),
                     ("ours bf16-master", "native bf16-mixed, fused=True", "reference"),
                     ("ours bf16-master", "ours bf16-master, torch's default step", "the fused step's gain"),
                     ("ours bf16-master, one pass", "native bf16-mixed, fused=True", "reference"),
                     ("ours bf16-master, one pass", "ours bf16-master", "the one pass's gain")]
            pairs.append(("single pass, eager chunks (prototype)", "ours bf16-master", "one pass vs the plugin's"))
            pairs.append(("gradient copy into one buffer (prototype)", "gradient copy alone", "no per-parameter cast"))
            if not args.no_compile:
                pairs.append(("compiled single pass", "ours bf16-master", "one pass vs the plugin's"))
            data = print_tables(f"AdamW step on the {name}'s {n} parameters, {threads} thread(s), "
                               f"{args.steps} steps per measurement", times, pairs)
            per = {k: 1e9 * statistics.median(v) / n for k, v in by_clock(times)["cpu"].items()}
            print("  CPU ns per parameter: " + ", ".join(f"{k} {v:.2f}" for k, v in per.items()))
            data = {"clocks": data, "model": name, "params": n, "compile_s": report.get("compile_s")}
            summaries.append(data)
    write_json(args.json, summaries)


if __name__ == "__main__":
    main()
