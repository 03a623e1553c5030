"""Lightning on a small GPT-2-style transformer: every recipe, ours vs native, alternating, with controls.

    python benchmarks/bench_transformer.py [--threads 1] [--rounds 6] [--steps 120] [--batch-size 4]
        [--seq 32] [--d-model 128] [--layers 2] [--model tiny|hf] [--by-fit] [--only TEXT ...]
        [--profile] [--json PATH] [--no-pin]

The MLP of bench_lightning.py has no attention, LayerNorm, GELU or embeddings,
so it hides the cost of the policy's FP32 regions; this model has all of them
(``bench_transformer_model.py``: GPT-2 as Hugging Face writes it, with its
``NewGELUActivation`` module, which the op policy does not know).  ``--model hf``
trains Hugging Face's ``GPT2LMHeadModel`` built from a config of the same size
instead (random init, no dropout; a third-party model with the same
``NewGELUActivation``).  Every variant trains the same model (same initial
weights, same random-token batches, AdamW lr 1e-3) through ``Trainer``, and
each native variant runs a second time as a control.  By default the variants
alternate step by step (``lockstep.py``: every fit in its own thread, one step
at a time, in a fresh random order each round; a step's figures its wall time and its
thread's CPU time; the process pinned to ``--threads`` CPUs, ``common.pin_cpus``, unless ``--no-pin``),
``--rounds`` windows of the steps after a tenth of warm-up,
a window's figure its median step, ratios the median of per-window ratios with
their min-max; ``--by-fit`` alternates whole fits instead (``common.alternate``,
``--rounds`` fits each, a fit's figure its median timed window:
:func:`mp_callbacks.app.measurement.step_timing`).

Variants: native (Lightning's ``Precision``/``MixedPrecision``) and ours
(``lightning_ext.MixedPrecision``) for 32-true, 16-mixed and bf16-mixed; ours
bf16-mixed with ``NewGELUActivation`` declared float32 (a module rule: the FP32
region the policy made of it before the tanh GELU became a float16-only FP32 op); ours 16-master,
bf16-master (fused master step, the default), bf16-master with torch's
default step (``fused_step=False``), bf16-kahan, bf16-sr; native bf16-mixed
with ``AdamW(fused=True)`` (what the fused kernel alone gives native); ours 32-true
and bf16-mixed with the inf/NaN check off (``scaler={"enabled": False,
"skip_nonfinite": False}``, the design's opt-out "for speed"): what the check costs.

``--profile`` instead runs the torch profiler over a few steps of native and
ours bf16-mixed (default and GELU in an FP32 region) and ours bf16-master, prints the
ops that take the time, and times the GELU module alone in an FP32 region vs
in bf16 (forward and backward, the casts around it included).
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from bench_transformer_model import GPTConfig, TinyGPT, hf_gpt2, lm_loss, token_batches  # noqa: E402
from common import (  # noqa: E402
    alternate,
    base_parser,
    by_clock,
    fit_figures,
    machine_line,
    per_step,
    pin_cpus,
    print_tables,
    with_controls,
    write_json,
)
from lightning.pytorch.plugins.precision import MixedPrecision as NativeMixed  # noqa: E402
from lightning.pytorch.plugins.precision import Precision  # noqa: E402
from lockstep import StepClock, lockstep  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from lightning_ext import MixedPrecision  # noqa: E402
from lightning_ext.check_native import native_check  # noqa: E402
from mp_callbacks.app.lightning_runner import state_bytes  # noqa: E402
from mp_callbacks.recipes import get_recipe  # noqa: E402

GELU_RULE = ("NewGELUActivation", "float32")  # the FP32 region the policy made of it before 2026-12-02


MODELS: dict[str, Callable[[GPTConfig], torch.nn.Module]] = {"tiny": TinyGPT, "hf": hf_gpt2}


class LM(pl.LightningModule):
    def __init__(self, cfg: GPTConfig, seed: int, fused_adamw: bool = False, model: str = "tiny") -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.net = MODELS[model](cfg)
        self.fused_adamw = fused_adamw

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        out = self.net(x)
        return lm_loss(out if isinstance(out, torch.Tensor) else out.logits, y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3, fused=True if self.fused_adamw else None)


class _Timer(pl.Callback):
    """Per-step wall time; bytes held at the optimizer step (start and end of the first two applied steps)."""

    def __init__(self, clock: StepClock | None = None) -> None:
        self.clock = clock  # lock-step: the step waits for its turn, the clock times it
        self.times: list[float] = []
        self.cpu_times: list[float] = []
        self.held = 0
        self._t0 = self._c0 = 0.0
        self._hooks: list[Any] = []
        self._applied = 0

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        opt = trainer.optimizers[0]
        plugin = trainer.precision_plugin
        rounding = getattr(plugin, "rounding", None)

        def measure(optimizer: Any, args: Any, kwargs: Any, post: bool = False) -> None:
            self.held = max(self.held, state_bytes(pl_module, optimizer, rounding.buffers() if rounding else ()))
            if post:
                self._applied += 1
                if self._applied >= 2:
                    for h in self._hooks:
                        h.remove()

        self._hooks = [opt.register_step_pre_hook(measure),
                       opt.register_step_post_hook(lambda o, a, k: measure(o, a, k, post=True))]

    def on_train_batch_start(self, *args: Any) -> None:
        if self.clock is not None:
            self.clock.begin()
        self._t0, self._c0 = time.perf_counter(), time.process_time()

    def on_train_batch_end(self, *args: Any) -> None:
        if self.clock is not None:
            self.clock.end()
            return
        self.times.append(time.perf_counter() - self._t0)
        self.cpu_times.append(time.process_time() - self._c0)


def prepare(plugin: Any, cfg: GPTConfig, batches: list, seed: int = 0, fused_adamw: bool = False,
            model: str = "tiny", clock: StepClock | None = None) -> tuple[LM, _Timer, Callable[[], None]]:
    """The module, its timer and the call that fits it (built now, trained when called)."""
    module = LM(cfg, seed, fused_adamw, model)
    timer = _Timer(clock)
    trainer = pl.Trainer(accelerator="cpu", devices=1, plugins=[plugin], max_steps=len(batches), max_epochs=1,
                         callbacks=[timer], logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0)
    return module, timer, lambda: trainer.fit(module, train_dataloaders=DataLoader(batches, batch_size=None))


def fit(plugin: Any, cfg: GPTConfig, batches: list, seed: int = 0, fused_adamw: bool = False,
        model: str = "tiny") -> tuple[LM, _Timer]:
    module, timer, run = prepare(plugin, cfg, batches, seed, fused_adamw, model)
    run()
    return module, timer


def ours(recipe: str, gelu_fp32: bool = False, fused_step: bool = True, check: bool = True) -> Callable[[], Any]:
    def make() -> Any:
        policy = get_recipe(recipe).policy
        if gelu_fp32:
            policy = dataclasses.replace(policy, module_rules=policy.module_rules + (GELU_RULE,))
        scaler = None if check else {"enabled": False, "skip_nonfinite": False}  # the design's opt-out
        plugin = MixedPrecision(recipe, "cpu", policy=policy, scaler=scaler)
        if plugin.masters is not None:
            plugin.masters.fused_step = fused_step
        return plugin
    return make


VARIANTS: dict[str, tuple[Callable[[], Any], bool]] = {  # name -> (plugin factory, AdamW fused=True)
    "native 32-true": (lambda: Precision(), False),
    "ours 32-true": (ours("32-true"), False),
    "ours 32-true, no inf/NaN check": (ours("32-true", check=False), False),
    "native 16-mixed": (lambda: NativeMixed("16-mixed", "cpu", torch.amp.GradScaler("cpu")), False),
    "ours 16-mixed": (ours("16-mixed"), False),
    "native bf16-mixed": (lambda: NativeMixed("bf16-mixed", "cpu"), False),
    "ours bf16-mixed": (ours("bf16-mixed"), False),
    "ours bf16-mixed, no inf/NaN check": (ours("bf16-mixed", check=False), False),
    "ours bf16-mixed, GELU in an FP32 region": (ours("bf16-mixed", gelu_fp32=True), False),
    "native bf16-mixed, AdamW(fused=True)": (lambda: NativeMixed("bf16-mixed", "cpu"), True),
    "ours 16-master": (ours("16-master"), False),
    "ours bf16-master": (ours("bf16-master"), False),
    "ours bf16-master, torch's default step": (ours("bf16-master", fused_step=False), False),
    "ours bf16-kahan": (ours("bf16-kahan"), False),
    "ours bf16-sr": (ours("bf16-sr"), False),
}
PAIRS = [
    ("ours 32-true", "native 32-true", "<= 1.02"),
    ("ours 32-true, no inf/NaN check", "native 32-true", "the check's price"),
    ("ours 16-mixed", "native 16-mixed", "<= 1.02"),
    ("ours bf16-mixed", "native bf16-mixed", "<= 1.02"),
    ("ours bf16-mixed, no inf/NaN check", "native bf16-mixed", "the check's price"),
    ("ours bf16-mixed", "ours bf16-mixed, GELU in an FP32 region", "the FP32 region saved"),
    ("ours 16-master", "native 16-mixed", "<= 0.95"),
    ("ours bf16-master", "native bf16-mixed", "<= 0.95"),
    ("ours bf16-master", "native bf16-mixed, AdamW(fused=True)", "reference"),
    ("ours bf16-master", "ours bf16-master, torch's default step", "the fused step's gain"),
    ("ours bf16-kahan", "native bf16-mixed", "none"),
    ("ours bf16-sr", "native bf16-mixed", "none"),
]
NATIVES = ["native 32-true", "native 16-mixed", "native bf16-mixed"]


def profile(cfg: GPTConfig, batches: list, threads: int) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    steps = len(batches) - 2
    for name in ("native bf16-mixed", "ours bf16-mixed", "ours bf16-mixed, GELU in an FP32 region", "ours bf16-master"):
        make, fused = VARIANTS[name]
        fit(make(), cfg, batches[:2])  # warm-up
        with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
            fit(make(), cfg, batches[2:], fused_adamw=fused)
        rows = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
        total = sum(e.self_cpu_time_total for e in rows) / steps / 1000
        print(f"\n{name}: {total:.1f} ms of op self time per step ({threads} thread(s)); top ops per step:")
        for e in rows[:12]:
            print(f"  {e.key:<44} {e.count / steps:7.1f} calls {e.self_cpu_time_total / steps / 1000:9.2f} ms")
    print("\nThe GELU module alone, forward + backward on a (batch*seq, ff) bf16 activation, "
          f"{threads} thread(s), the casts around it included (alternating, median of 31):")
    from bench_transformer_model import NewGELUActivation

    act = NewGELUActivation()
    x16 = torch.randn(batches[0][0].numel(), cfg.ff).to(torch.bfloat16)
    grad16 = torch.ones_like(x16)

    def region_fp32() -> None:  # the policy: cast in, FP32 math, FP32 out; the next Linear's autocast casts back
        x = x16.detach().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=False):
            y = act(x.float())
        y.to(torch.bfloat16).backward(grad16)

    def region_bf16() -> None:  # autocast alone: the elementwise ops follow their bf16 input
        x = x16.detach().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = act(x)
        y.backward(grad16)

    fns = {"FP32 region (the default for an unknown module)": region_fp32, "bf16, as autocast runs it": region_bf16}
    times = by_clock(alternate({label: per_step(fn, 1) for label, fn in fns.items()}, 31))["wall"]
    for label, ts in times.items():
        ts.sort()
        print(f"  {label:<50} {1000 * ts[15]:8.3f} ms  (quartiles {1000 * ts[8]:.3f}-{1000 * ts[23]:.3f})")


def main() -> None:
    parser = base_parser(__doc__, rounds=6, steps=120, batch_size=4)
    parser.set_defaults(threads=[1])
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--only", nargs="+", default=None, metavar="TEXT",
                        help="run only the variants whose name contains one of these (and the natives they need)")
    parser.add_argument("--profile", action="store_true", help="profile instead of timing the variants")
    parser.add_argument("--model", choices=sorted(MODELS), default="tiny",
                        help="tiny: the hand-written GPT-2 twin; hf: Hugging Face's GPT2LMHeadModel from a config")
    parser.add_argument("--by-fit", action="store_true",
                        help="alternate whole fits (--rounds fits per variant) instead of single steps")
    args = parser.parse_args()
    import logging
    import warnings

    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    cfg = GPTConfig(vocab=args.vocab, seq=args.seq, d_model=args.d_model, heads=4, layers=args.layers,
                    ff=4 * args.d_model)
    batches = token_batches(cfg, args.steps, args.batch_size)
    n_params = sum(p.numel() for p in MODELS[args.model](cfg).parameters())
    summaries = []
    for threads in args.threads:
        torch.set_num_threads(threads)
        print(machine_line(threads) + ("" if args.no_pin else pin_cpus(threads)))
        native_check()  # built (once per machine) and loaded before any step is timed
        if args.profile:
            profile(cfg, batches, threads)
            continue
        pairs = [p for p in PAIRS if args.only is None or any(t in p[0] for t in args.only)]
        names = list(dict.fromkeys(n for p in pairs for n in p[:2]))
        held: dict[str, float] = {}

        def measure(name: str) -> Callable[[], tuple[float, float]]:
            make, fused = VARIANTS[name]

            def once() -> tuple[float, float]:
                _, timer = fit(make(), cfg, batches, fused_adamw=fused, model=args.model)
                held[name] = timer.held / n_params  # noqa: B023 - one dict per thread count, read right after
                return fit_figures(timer.times, timer.cpu_times)
            return once

        def stepped(name: str) -> Callable[[StepClock], Callable[[], None]]:
            make, fused = VARIANTS[name]

            def build(clock: StepClock) -> Callable[[], None]:
                _, timer, run = prepare(make(), cfg, batches, fused_adamw=fused, model=args.model, clock=clock)

                def train() -> None:
                    run()
                    held[name] = timer.held / n_params  # noqa: B023 - read after the join
                return train
            return build

        if args.by_fit:
            times = alternate(with_controls({n: measure(n) for n in names}, [n for n in NATIVES if n in names]),
                              args.rounds)
            how = f"{args.steps} steps/fit, {args.rounds} fits alternating"
        else:
            times = lockstep(with_controls({n: stepped(n) for n in names}, [n for n in NATIVES if n in names]),
                             args.steps, args.rounds)
            how = f"{args.steps} steps alternating step by step, {args.rounds} windows"
        data = print_tables(
            f"Lightning, {'Hugging Face GPT2LMHeadModel' if args.model == 'hf' else 'GPT-2-style transformer'} "
            f"({args.layers} layers, d_model {args.d_model}, seq {args.seq}, vocab {args.vocab}, {n_params} params), "
            f"batch {args.batch_size}, {how}, {threads} thread(s), AdamW", times, pairs)
        print("  model state at the optimizer step (B/param): "
              + ", ".join(f"{k} {v:.2f}" for k, v in held.items() if k.startswith("ours")))
        data = {"clocks": data, "held_bytes_per_param": held}
        summaries.append(data)
    write_json(args.json, summaries)


if __name__ == "__main__":
    main()
