"""The plugin's per-step work on its own, against what native runs in its place, alternating, with controls.

    python benchmarks/bench_plugin_overhead.py [--threads 1] [--rounds 7] [--steps 300]

Whole-step ratios (bench_transformer.py) cannot resolve a cost of 0.1-1% of a step on a shared
machine; this script times the pieces in tight loops.  Pairs (ours / native, under bf16 autocast,
shapes of bench_transformer.py's model: (4, 32, 128) activations; forward only for the neutral
modules, whose region adds nothing to the backward; forward + backward for GELU):

* an FP32 region around a ``LayerNorm`` and an ``Embedding`` (lightning_ext.policy) vs the module
  called as native autocast calls it;
* the GELU module (``NewGELUActivation``) in its FP32 region vs in bf16 (the feature's price).

Per-step work that native does not do at all is timed alone (microseconds per call, no ratio):
keeping the forward's buffers (``ForwardState.begin`` on bench_transformer.py's model), the
divergence rule on an applied step, the scaler transition (scaling off: ``32-true``/``bf16-*``;
the ``torch`` preset: ``16-mixed``), the fused non-finite check over the model's gradients (the kernel
alone, and the scaler's check with scaling off, as a step runs it), the fused-kernel check of the
``*-master`` step (``lightning_ext.fused_step.fusable_groups``, AdamW over the model's parameters), and
read-only candidates for the check with scaling off: ``torch._foreach_max`` (misses a tensor whose
only non-finite value is -inf), ``torch._foreach_norm`` with ``ord=inf`` (exact), ``ord=2`` (overflows
to inf for large finite gradients) and ``ord=2`` in float64 (exact), ``torch.aminmax`` per gradient
(exact, a Python loop).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from bench_transformer_model import GPTConfig, NewGELUActivation, TinyGPT, lm_loss, token_batches  # noqa: E402
from common import alternate, base_parser, machine_line, per_step, print_tables, with_controls  # noqa: E402

from lightning_ext.divergence import TorchDivergence  # noqa: E402
from lightning_ext.forward_state import ForwardState  # noqa: E402
from lightning_ext.fused_step import fusable_groups  # noqa: E402
from lightning_ext.policy import ModulePolicyHandle  # noqa: E402
from lightning_ext.scaler import TorchLossScaler  # noqa: E402
from mp_callbacks.loss_scale import ScalerConfig  # noqa: E402


def _timed(module: torch.nn.Module, x: torch.Tensor, backward: bool) -> Any:
    def body() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = module(x)
        if backward:
            y.float().sum().backward()
    return body


def variants(cfg: GPTConfig) -> dict[str, Any]:
    x = torch.randn(4, cfg.seq, cfg.d_model, requires_grad=True)
    idx = torch.randint(0, cfg.vocab, (4, cfg.seq))
    h = torch.randn(4, cfg.seq, cfg.ff).to(torch.bfloat16).requires_grad_()
    out: dict[str, Any] = {}
    for name, make, inp in (("LayerNorm", lambda: torch.nn.LayerNorm(cfg.d_model), x),
                            ("Embedding", lambda: torch.nn.Embedding(cfg.vocab, cfg.d_model), idx),
                            ("GELU", NewGELUActivation, h)):
        native, ours = make(), make()
        ModulePolicyHandle().add_region(ours, name, "cpu")
        backward = name == "GELU"  # a neutral module's region adds nothing to its backward
        out[f"native {name}" if name != "GELU" else "GELU in bf16 (declared)"] = _timed(native, inp, backward)
        out[f"ours {name} FP32 region"] = _timed(ours, inp, backward)
    net = TinyGPT(cfg)
    xb, yb = token_batches(cfg, 1, 4)[0]
    lm_loss(net(xb), yb).backward()
    grads = [p.grad for p in net.parameters()]
    state = ForwardState()

    def keep_buffers() -> None:
        state._armed = False
        state.begin(net)

    rule, one, zero = TorchDivergence(), torch.ones(()), torch.zeros(())
    off, torch_preset = TorchLossScaler(get_off()), TorchLossScaler(ScalerConfig.preset("torch"))

    def check() -> None:
        torch._amp_foreach_non_finite_check_and_unscale_(grads, torch.zeros(()), one)

    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    opt.step()  # its state exists, as from the second step on

    out.update({
        "alone: ForwardState.begin (model of bench_transformer.py)": keep_buffers,
        "alone: divergence rule, applied step": lambda: rule.observe(False, one, zero),
        "alone: scaler transition, scaling off": lambda: off.record_transition(zero > 0),
        "alone: scaler transition, torch preset": lambda: torch_preset.record_transition(zero > 0),
        "alone: fused non-finite check, the model's gradients": check,
        "alone: the scaler's check, scaling off (the model's gradients)":
            lambda: off._check_and_unscale(opt, one.device),
        "alone: fused_step.fusable_groups (AdamW, the model's parameters)": lambda: fusable_groups(opt),
        "alone: read-only candidate, torch._foreach_max (misses -inf)":
            lambda: torch.stack(torch._foreach_max(grads)),
        "alone: read-only candidate, torch._foreach_norm(ord=inf)": lambda: torch._foreach_norm(grads, math.inf),
        "alone: read-only candidate, torch._foreach_norm(ord=2) (overflows)": lambda: torch._foreach_norm(grads, 2),
        "alone: read-only candidate, torch._foreach_norm(ord=2, float64)":
            lambda: torch._foreach_norm(grads, 2, dtype=torch.float64),
        "alone: read-only candidate, torch.aminmax per gradient": lambda: [torch.aminmax(g) for g in grads],
    })
    return out


def get_off() -> ScalerConfig:
    from mp_callbacks.recipes import get_recipe

    return get_recipe("32-true").scaler


PAIRS = [
    ("ours LayerNorm FP32 region", "native LayerNorm", "~1.0 (no op autocast lowers)"),
    ("ours Embedding FP32 region", "native Embedding", "~1.0 (no op autocast lowers)"),
    ("ours GELU FP32 region", "GELU in bf16 (declared)", "the FP32 region's price"),
]
NATIVES = ["native LayerNorm", "native Embedding", "GELU in bf16 (declared)"]


def main() -> None:
    parser = base_parser(__doc__, rounds=7, steps=300)
    parser.set_defaults(threads=[1])
    args = parser.parse_args()
    cfg = GPTConfig()
    for threads in args.threads:
        torch.set_num_threads(threads)
        print(machine_line(threads))
        bodies = variants(cfg)
        timed = with_controls({k: per_step(v, args.steps) for k, v in bodies.items()}, NATIVES)
        for fn in timed.values():
            fn()  # warm-up
        print_tables(f"The plugin's per-step pieces, {args.steps} calls per round, {threads} thread(s) "
                     "(median ms per call)", alternate(timed, args.rounds), PAIRS)


if __name__ == "__main__":
    main()
