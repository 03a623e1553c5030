"""The measurements of ``gpu_check.py``: sizes, models, the CUDA-synchronised clock, bytes per parameter, the Linear
stack's forward passes.

Every timed section goes through ``harness.py`` (variants in turns, controls, median per-round ratios) with the
variants of ``lightning_variants.py`` (``Trainer(plugins=[...])``, ours or Lightning's native plugin).  On CUDA each
variant's clock is wrapped by :class:`DeviceClock`: the device is synchronised when a step starts and before it is
timed as ended, and the peak allocated memory of each of its turns above the allocation when the turn began (every
other variant's state is resting then) is kept.
"""

from __future__ import annotations

import dataclasses
import gc
from collections.abc import Callable
from typing import Any

import harness
import lightning_variants as lv
import torch
import torch_models as tm
from harness import Variant
from torch import nn

from mp_callbacks import estimate_memory, get_recipe

RECIPES = ("32-true", "16-mixed", "bf16-mixed", "16-master", "bf16-master", "bf16-kahan", "bf16-sr", "fp8-mixed")


@dataclasses.dataclass(frozen=True)
class Sizes:
    """What the check trains: the GPT model and batch, the rounds, the Linear stack, the bytes/param fit."""

    layers: int = 12
    d_model: int = 768
    seq: int = 1024
    vocab: int = 50304  # GPT-2's 50257 padded to a multiple of 64 (as nanoGPT): tensor-core-shaped head
    batch: int = 8  # every variant's model and optimizer stay resident while the variants take turns
    warmup: int = 2
    rounds: int = 3
    steps: int = 4
    linear_dim: int = 4096
    linear_depth: int = 8
    linear_tokens: int = 16384
    bytes_batch: int = 2
    bytes_seq: int = 64
    counter_d_model: int = 128  # launches.py's model on the device
    counter_layers: int = 2


DRY_SIZES = Sizes(layers=1, d_model=32, seq=16, vocab=64, batch=2, warmup=1, rounds=1, steps=1, linear_dim=32,
                  linear_depth=2, linear_tokens=16, bytes_batch=1, bytes_seq=8, counter_d_model=32, counter_layers=1)


def gpt_factory(s: Sizes, use_hf: bool) -> tuple[Callable[[], nn.Module], str]:
    """``make_net`` of the GPT model (the same initial weights every call) and what it is."""
    cfg = tm.GPTConfig(vocab=s.vocab, seq=s.seq, d_model=s.d_model, heads=max(1, s.d_model // 64), layers=s.layers,
                       ff=4 * s.d_model)
    model = "hf" if use_hf else "tiny"
    desc = (f"transformers GPT2LMHeadModel from a GPT2Config (n_layer={s.layers}, n_embd={s.d_model}, "
            f"n_positions={s.seq}, vocab {s.vocab}, random init)" if use_hf else
            f"the transformer benchmark model (torch_models.TinyGPT: {s.layers} layers, d_model {s.d_model}, "
            f"seq {s.seq}, vocab {s.vocab}; untied head)")
    return (lambda: tm.build(model, cfg)), desc


def gpt_batches(s: Sizes, n: int, batch: int, seq: int | None = None) -> list:
    return tm.token_batches(tm.GPTConfig(vocab=s.vocab, seq=seq or s.seq), n, batch)


class LinearStack(nn.Module):
    """``depth`` bias-free ``Linear(dim, dim)`` layers on a fixed input held as a buffer (on the device with the
    module: no host copy per step); the batch is ignored."""

    def __init__(self, dim: int, depth: int, tokens: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(*(nn.Linear(dim, dim, bias=False) for _ in range(depth)))
        self.register_buffer("x", torch.randn(tokens, dim), persistent=False)

    def forward(self, _: Any = None) -> torch.Tensor:
        return self.net(self.x)


def square_loss(out: torch.Tensor, _: Any) -> torch.Tensor:
    return out.float().square().mean()


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


class DeviceClock:
    """A harness clock seen through the device: synchronised at a step's begin and end (CUDA), each turn's peak
    memory above its start recorded in ``peaks`` (MB)."""

    def __init__(self, clock: harness.Clock, device: str, turn_sizes: list[int], peaks: list[float]) -> None:
        self.clock, self.device, self.peaks, self.total = clock, device, peaks, clock.total
        self._starts = {sum(turn_sizes[:i]) for i in range(len(turn_sizes))}
        self._ends = {sum(turn_sizes[:i + 1]) - 1 for i in range(len(turn_sizes))}
        self._step = 0
        self._base = 0

    def begin(self) -> None:
        sync(self.device)  # the device is idle (every turn ends synchronised): nothing queued is timed
        self.clock.begin()
        if self.device == "cuda" and self._step in self._starts:
            torch.cuda.reset_peak_memory_stats()
            self._base = torch.cuda.memory_allocated()

    def end(self) -> None:
        sync(self.device)
        if self.device == "cuda" and self._step in self._ends:
            self.peaks.append((torch.cuda.max_memory_allocated() - self._base) / 2**20)
        self._step += 1
        self.clock.end()


def on_device(build: harness.Build, device: str, s: Sizes, peaks: list[float]) -> harness.Build:
    turns = ([s.warmup] if s.warmup else []) + [s.steps] * s.rounds
    return lambda clock: build(DeviceClock(clock, device, turns, peaks))


def timed(builds: dict[str, harness.Build], references: list[str], pairs: list[tuple[str, str]], s: Sizes,
          device: str) -> dict[str, Any]:
    """The harness over ``builds`` on ``device``: the summary, with each variant's largest turn peak (MB above
    its turn's start; CUDA)."""
    peaks: dict[str, list[float]] = {}
    wrapped = {}
    for name, build in harness.with_controls(builds, references).items():
        wrapped[name] = on_device(build, device, s, peaks.setdefault(name, []))
    times = harness.run_rounds(wrapped, s.rounds, s.steps, s.warmup)
    data = harness.summarize(times, pairs)
    for name, v in data["variants"].items():
        v["peak_mb_above_rest"] = max(peaks[name]) if peaks.get(name) else None
    return data


def release(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def bytes_per_param_row(recipe: str, make_net: Callable[[], nn.Module], batches: list, device: str) -> dict:
    """One recipe's model state at the optimizer step: the CUDA allocator above its level before the model existed
    (the larger at the step's start and end, first two steps; None on the CPU), next to
    ``mp_callbacks.estimate_memory`` for the dtypes the parameters ended in."""
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    release(device)
    sync(device)
    base = torch.cuda.memory_allocated() if device == "cuda" else 0
    seen: list[int] = []

    def measure(*_: Any) -> None:
        if device == "cuda" and len(seen) < 4:
            sync(device)
            seen.append(torch.cuda.memory_allocated() - base)

    hooks = [register_optimizer_step_pre_hook(measure), register_optimizer_step_post_hook(measure)]
    nets: list[nn.Module] = []

    def kept() -> nn.Module:
        nets.append(make_net())
        return nets[-1]

    try:
        lv.trainer_build(Variant("ours", recipe), kept, batches, tm.lm_loss, device)(_Steps(len(batches)))()
    finally:
        for h in hooks:
            h.remove()
    params = list(nets[-1].parameters())
    n = sum(p.numel() for p in params)
    dtypes = [(p.numel(), str(p.dtype).replace("torch.", "")) for p in params]
    est = estimate_memory(get_recipe(recipe).master, "adamw", dtypes, fp32_master_grads=True, weights_released=True)
    row = {"recipe": recipe, "params": n, "estimate_bytes_per_param": est.total / n,
           "allocated_bytes_per_param": max(seen) / n if seen else None,
           "fp32_params": sum(k for k, d in dtypes if d == "float32")}
    nets.clear()
    release(device)
    return row


class _Steps:
    """A clock that only counts (an untimed fit)."""

    def __init__(self, total: int) -> None:
        self.total = total

    def begin(self) -> None:
        pass

    def end(self) -> None:
        pass


def linear_forward(s: Sizes, device: str) -> dict[str, Any]:
    """Forward passes alone (no grad) of the Linear stack: ours ``fp8-mixed`` and ``bf16-mixed`` (the plugin's
    ``convert_module`` + ``forward_context``, Lightning's Precision API) and native bf16 autocast, in turns; the
    ``_scaled_mm`` calls per forward (FP8 tensor-core matmuls) counted by ``launches.StepCounter``."""
    from launches import StepCounter

    builds: dict[str, harness.Build] = {}
    scaled_mm: dict[str, int] = {}
    for name in ("ours fp8-mixed forward", "ours bf16-mixed forward", "native bf16-mixed forward"):
        side, recipe, _ = name.split(" ")

        def build(clock: Any, side: str = side, recipe: str = recipe, name: str = name) -> Callable[[], None]:
            module = LinearStack(s.linear_dim, s.linear_depth, s.linear_tokens).to(device)
            plugin = lv.trainer_plugin(Variant(side, recipe), device)
            if side == "ours":
                module = plugin.convert_module(module)
            ctx = plugin.forward_context

            def forward() -> None:
                with torch.no_grad(), ctx():
                    module()
            counter = StepCounter(0, device)
            counter.begin()
            forward()
            counter.end()
            scaled_mm[name] = counter.ops.get("_scaled_mm", 0)
            return harness.loop(clock, forward)
        builds[name] = build
    pairs = [("ours fp8-mixed forward", "ours bf16-mixed forward"), ("ours fp8-mixed forward",
                                                                     "native bf16-mixed forward"),
             ("ours bf16-mixed forward", "native bf16-mixed forward")]
    data = timed(builds, ["native bf16-mixed forward"], pairs, s, device)
    data["scaled_mm_per_forward"] = scaled_mm
    return data
