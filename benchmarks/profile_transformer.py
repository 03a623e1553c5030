"""Where a Lightning step's time goes, per recipe: torch profiler by op and by the plugin's own hooks.

    python benchmarks/profile_transformer.py [--threads 1] [--steps 16] [--model tiny|hf ...]
        [--only TEXT ...] [--top 10]

Models: ``tiny`` is bench_transformer.py's GPT-2-style twin (2 layers, d_model 128, seq 32,
vocab 512, batch 4); ``hf`` is Hugging Face's ``GPT2LMHeadModel`` built from a config of the
same size (random init, dropout 0; needs ``transformers``).  Each variant trains through the
``Trainer`` as bench_transformer.py does (a 2-step warm-up fit, then a profiled fit).

Printed per variant: op self time per step and the top ops; the ops whose count or self time
per step differ from the native plugin of the same precision (what ours adds or removes); and
the plugin's hooks, each wrapped in a ``record_function`` range for the profile only (this script
patches them; the library has no ranges): calls and CPU time per step, children included.
A hook's time includes the ops it launches (the overflow check's kernel is inside
``scaler.unscale``).  The ranges cost a few microseconds each: read them as attribution, and
take ratios from bench_transformer.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from bench_transformer_model import GPTConfig, TinyGPT, hf_gpt2, lm_loss, token_batches  # noqa: E402
from common import machine_line  # noqa: E402
from lightning.pytorch.plugins.precision import MixedPrecision as NativeMixed  # noqa: E402
from lightning.pytorch.plugins.precision import Precision  # noqa: E402
from torch.profiler import ProfilerActivity, record_function  # noqa: E402
from torch.profiler import profile as torch_profile  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from lightning_ext import (  # noqa: E402
    MixedPrecision,  # noqa: E402
    adam_native,
    forward_state,
    master_native,
    masters,
    plugin,
    policy,
    scaler,
)
from lightning_ext import divergence as divergence_mod  # noqa: E402
from lightning_ext import fabric as fabric_mod  # noqa: E402
from mp_callbacks.recipes import get_recipe  # noqa: E402

GELU_RULES = (("NewGELUActivation", "float32"),)  # its FP32 region (the default before 2026-12-02)


class LM(pl.LightningModule):
    def __init__(self, make_net: Callable[[], torch.nn.Module], seed: int, fused: bool = False) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.net = make_net()
        self.fused = fused

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        out = self.net(x)
        return lm_loss(out.logits if hasattr(out, "logits") else out, y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3, fused=self.fused or None)


def fit(plugin_: Any, make_net: Callable[[], torch.nn.Module], batches: list, fused: bool = False) -> None:
    trainer = pl.Trainer(accelerator="cpu", devices=1, plugins=[plugin_], max_steps=len(batches), max_epochs=1,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(LM(make_net, 0, fused), train_dataloaders=DataLoader(batches, batch_size=None))


def ours(recipe: str, module_rules: tuple = ()) -> Callable[[], Any]:
    def make() -> Any:
        pol = get_recipe(recipe).policy
        pol = dataclasses.replace(pol, module_rules=pol.module_rules + module_rules)
        return MixedPrecision(recipe, "cpu", policy=pol)
    return make


VARIANTS: dict[str, tuple[Callable[[], Any], str | None]] = {  # name -> (plugin factory, native to diff against)
    "native 32-true": (lambda: Precision(), None),
    "ours 32-true": (ours("32-true"), "native 32-true"),
    "native bf16-mixed": (lambda: NativeMixed("bf16-mixed", "cpu"), None),
    "ours bf16-mixed": (ours("bf16-mixed"), "native bf16-mixed"),
    "ours bf16-mixed, GELU in an FP32 region": (ours("bf16-mixed", GELU_RULES), "native bf16-mixed"),
    "ours bf16-master": (ours("bf16-master"), "native bf16-mixed"),
    "native bf16-mixed, AdamW(fused=True)": (lambda: NativeMixed("bf16-mixed", "cpu"), None),
    "ours bf16-master (against fused)": (ours("bf16-master"), "native bf16-mixed, AdamW(fused=True)"),
}
FUSED = {"native bf16-mixed, AdamW(fused=True)"}  # the variants whose AdamW runs torch's fused kernel

# (owner, attribute, range label): the plugin's per-step hooks (what bench_transformer.py's ratios pay for).
HOOKS: list[tuple[Any, str, str]] = [
    (plugin.MixedPrecision, "pre_backward", "plugin.pre_backward (loss * scale)"),
    (fabric_mod.MixedPrecision, "forward_context", "plugin.forward_context"),
    (forward_state.ForwardState, "begin", "forward_state.begin (buffers kept)"),
    (forward_state.ForwardState, "end", "forward_state.end"),
    (divergence_mod.TorchDivergence, "record_loss", "divergence.record_loss (isfinite)"),
    (divergence_mod.TorchDivergence, "observe", "divergence.observe"),
    (scaler.TorchLossScaler, "unscale_once", "scaler.unscale (grads to masters + check)"),
    (scaler.TorchLossScaler, "_check_and_unscale", "scaler non-finite check (fused kernel)"),
    (masters.MasterWeights, "collect_grads", "masters.collect_grads (bf16 grad -> fp32)"),
    (scaler.TorchLossScaler, "skips", "scaler.skips (host read of found_inf)"),
    (masters.MasterWeights, "copy_to_params", "masters.copy_to_params (fp32 -> bf16)"),
    (scaler.TorchLossScaler, "update", "scaler.update (state transition)"),
    (fabric_mod.MixedPrecision, "_after_step", "plugin._after_step"),
    (torch.optim.AdamW, "step", "AdamW.step (not ours; ours run it)"),
    (scaler, "host_check", "scaler.host_check (the native scan + decision)"),
    (masters, "alias_grads", "master_native.alias_grads (bf16 grads onto the masters)"),
    (master_native, "_take_over", "master_native._take_over (the fused call, Python + C)"),
    (master_native.NativeAdam, "step", "master_native.NativeAdam.step (the C pass)"),
    (adam_native.NativeSingleAdam, "step", "adam_native.NativeSingleAdam.step (the C pass)"),
]


def _ranged(fn: Any, label: str) -> Any:
    if isinstance(fn, staticmethod):
        return staticmethod(_ranged(fn.__func__, label))

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with record_function(f"mp: {label}"):
            return fn(*args, **kwargs)
    return wrapper


@contextlib.contextmanager
def hook_ranges() -> Iterator[None]:
    """Wrap every :data:`HOOKS` entry, and each FP32 region's forward, in a profiler range; undo on exit."""
    saved = [(owner, attr, owner.__dict__[attr]) for owner, attr, _ in HOOKS if attr in owner.__dict__]
    for owner, attr, label in HOOKS:
        if attr in owner.__dict__:
            setattr(owner, attr, _ranged(owner.__dict__[attr], label))
    add_region = policy.ModulePolicyHandle.add_region

    def add_ranged_region(self: Any, module: torch.nn.Module, path: str, device_type: str) -> None:
        add_region(self, module, path, device_type)
        if module.__dict__.get("forward") is not None and path in self.paths:
            module.forward = _ranged(module.__dict__["forward"], f"FP32 region {type(module).__name__} (fwd)")

    policy.ModulePolicyHandle.add_region = add_ranged_region  # type: ignore[method-assign]
    try:
        yield
    finally:
        policy.ModulePolicyHandle.add_region = add_region  # type: ignore[method-assign]
        for owner, attr, fn in saved:
            setattr(owner, attr, fn)


def profile_variant(name: str, make_net: Callable[[], torch.nn.Module], batches: list) -> dict[str, Any]:
    make, _ = VARIANTS[name]
    fit(make(), make_net, batches[:2], name in FUSED)  # warm-up
    with hook_ranges(), torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        fit(make(), make_net, batches, name in FUSED)
    steps = len(batches)
    out: dict[str, Any] = {"ops": {}, "hooks": {}}
    for e in prof.key_averages():
        if e.key.startswith("mp: "):
            out["hooks"][e.key[4:]] = (e.count / steps, e.cpu_time_total / steps / 1000)
        elif not e.key.startswith(("ProfilerStep", "[")) and e.self_cpu_time_total > 0:
            out["ops"][e.key] = (e.count / steps, e.self_cpu_time_total / steps / 1000)
    return out


def report(name: str, data: dict[str, Any], native: dict[str, Any] | None, top: int) -> None:
    ops = data["ops"]
    total = sum(ms for _, ms in ops.values())
    print(f"\n{name}: {total:.2f} ms op self time per step; top ops (calls, ms per step):")
    for key, (n, ms) in sorted(ops.items(), key=lambda kv: -kv[1][1])[:top]:
        print(f"  {key:<52} {n:7.1f} {ms:8.3f}")
    if native is not None:
        base = native["ops"]
        diffs = []
        for key in set(ops) | set(base):
            n, ms = ops.get(key, (0.0, 0.0))
            n0, ms0 = base.get(key, (0.0, 0.0))
            if abs(n - n0) >= 0.5:
                diffs.append((key, n - n0, ms - ms0))
        print(f"  ops whose count per step differs from {VARIANTS[name][1]} (calls, ms per step, ours - native):")
        for key, dn, dms in sorted(diffs, key=lambda d: -abs(d[2]))[:top]:
            print(f"    {key:<50} {dn:+7.1f} {dms:+8.3f}")
    if data["hooks"]:
        print("  the plugin's hooks (calls, CPU ms per step, children included):")
        for key, (n, ms) in sorted(data["hooks"].items(), key=lambda kv: -kv[1][1]):
            print(f"    {key:<50} {n:7.1f} {ms:8.3f}")


def main() -> None:
    import argparse
    import logging
    import warnings

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--model", nargs="+", default=["tiny", "hf"], choices=["tiny", "hf"])
    parser.add_argument("--only", nargs="+", default=None, metavar="TEXT")
    parser.add_argument("--top", type=int, default=10)
    args = parser.parse_args()
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    torch.set_num_threads(args.threads)
    print(machine_line(args.threads))
    cfg = GPTConfig()
    batches = token_batches(cfg, args.steps, args.batch_size)
    names = [n for n in VARIANTS if args.only is None or any(t in n for t in args.only)]
    for model in args.model:
        make_net = (lambda: TinyGPT(cfg)) if model == "tiny" else functools.partial(hf_gpt2, cfg)
        print(f"\n=== model {model}: {sum(p.numel() for p in make_net().parameters())} params, batch "
              f"{args.batch_size}, seq {cfg.seq}, {args.steps} profiled steps, {args.threads} thread(s)")
        results: dict[str, dict[str, Any]] = {}
        for name in names:
            native = VARIANTS[name][1]
            if native is not None and native not in results:
                results[native] = profile_variant(native, make_net, batches)
            if name not in results:
                results[name] = profile_variant(name, make_net, batches)
        for name in names:
            native = VARIANTS[name][1]
            report(name, results[name], results.get(native) if native else None, args.top)


if __name__ == "__main__":
    main()
