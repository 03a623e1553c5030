"""The measurements of ``gpu_check.py``: models, Trainer fits, timed windows, bytes held.

Every fit goes through Lightning's ``Trainer`` with a precision plugin: ours
(``lightning_ext.MixedPrecision(recipe, device=...)``) or Lightning's native one, built exactly as
the Trainer builds it from a precision string (``"32-true"``: ``Precision()``; ``"16-mixed"``:
``MixedPrecision("16-mixed", device, GradScaler(device))``; ``"bf16-mixed"``). A fit's figure is one
timed window after warm-up, opened and closed with ``torch.cuda.synchronize()`` on CUDA; the
variants alternate in one process (``common.alternate``, order reversed every other round).
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import time
from collections.abc import Callable, Iterable
from typing import Any

import lightning.pytorch as pl
import torch
from bench_transformer_model import GPTConfig, TinyGPT, lm_loss, token_batches
from common import alternate
from lightning.pytorch.plugins.precision import MixedPrecision as NativeMixed
from lightning.pytorch.plugins.precision import Precision
from torch import nn
from torch.utils.data import DataLoader

from lightning_ext import MixedPrecision
from mp_callbacks import estimate_memory

RECIPES = ("32-true", "16-mixed", "bf16-mixed", "bf16-master", "bf16-kahan", "bf16-sr", "fp8-mixed")
NATIVES = ("32-true", "16-mixed", "bf16-mixed")
NATIVE_OF = {r: (r if r in NATIVES else "bf16-mixed") for r in RECIPES}
"""The native precision each recipe is compared with (the ``*-master``/rounding/FP8 recipes: bf16-mixed)."""


@dataclasses.dataclass(frozen=True)
class Sizes:
    """What the check trains: the GPT model and batch, the Linear stack, the bytes/param fit."""

    layers: int = 12
    d_model: int = 768
    heads: int = 12
    seq: int = 1024
    vocab: int = 50304
    batch: int = 16
    warmup: int = 3
    steps: int = 6
    linear_dim: int = 4096
    linear_depth: int = 8
    linear_tokens: int = 16384
    bytes_batch: int = 1
    bytes_seq: int = 64


DRY_SIZES = Sizes(layers=1, d_model=32, heads=2, seq=16, vocab=64, batch=2, warmup=1, steps=2, linear_dim=32,
                  linear_depth=2, linear_tokens=16, bytes_batch=1, bytes_seq=8)


def cuda_sync(device: str) -> None:
    """Wait for the device (CUDA only): a timed window starts and ends on an idle GPU."""
    if device == "cuda":
        torch.cuda.synchronize()


def gpt_template(s: Sizes, use_hf: bool) -> tuple[nn.Module, str]:
    """The GPT model every fit starts from (copied per fit) and what it is.

    ``use_hf``: Hugging Face's ``GPT2LMHeadModel`` from a ``GPT2Config`` (random init, SDPA attention,
    tied embeddings, no cache), imported here so that nothing else needs ``transformers``; else the
    hand-written twin of ``bench_transformer_model.TinyGPT`` (untied head).
    """
    torch.manual_seed(0)
    if use_hf:
        from transformers import GPT2Config, GPT2LMHeadModel

        cfg = GPT2Config(n_layer=s.layers, n_embd=s.d_model, n_head=s.heads, n_positions=s.seq, vocab_size=s.vocab,
                         use_cache=False)
        try:
            cfg._attn_implementation = "sdpa"
        except Exception:  # noqa: BLE001 - older/newer configs: keep the library's default
            pass
        model = GPT2LMHeadModel(cfg)
        impl = getattr(model.config, "_attn_implementation", "?")
        return model, f"transformers GPT2LMHeadModel (GPT2Config n_layer={s.layers}, n_embd={s.d_model}, " \
                      f"n_head={s.heads}, n_positions={s.seq}, vocab_size={s.vocab}; attention {impl})"
    cfg = GPTConfig(vocab=s.vocab, seq=s.seq, d_model=s.d_model, heads=s.heads, layers=s.layers, ff=4 * s.d_model)
    return TinyGPT(cfg), f"built-in TinyGPT (benchmarks/bench_transformer_model.py: {s.layers} layers, " \
                         f"d_model {s.d_model}, {s.heads} heads, seq {s.seq}, vocab {s.vocab}; untied head)"


def gpt_batches(s: Sizes, n: int, batch: int, seq: int | None = None) -> list:
    """``n`` batches of random tokens (inputs, next-token targets), the same for every fit."""
    return token_batches(GPTConfig(vocab=s.vocab, seq=seq or s.seq), n, batch)


class LM(pl.LightningModule):
    """A copy of ``template`` trained as a language model with AdamW(lr 3e-4), loss in FP32."""

    def __init__(self, template: nn.Module) -> None:
        super().__init__()
        self.net = copy.deepcopy(template)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        out = self.net(x)
        return lm_loss(getattr(out, "logits", out), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=3e-4)


class LinearStack(pl.LightningModule):
    """``depth`` bias-free ``Linear(dim, dim)`` layers on a fixed device-resident input (no host copy per step),
    loss ``mean(out**2)`` in FP32, AdamW."""

    def __init__(self, dim: int, depth: int, tokens: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(*(nn.Linear(dim, dim, bias=False) for _ in range(depth)))
        self.shape = (tokens, dim)
        self.x: torch.Tensor | None = None

    def on_fit_start(self) -> None:
        g = torch.Generator(device=self.device).manual_seed(1)  # drawn on the device: same values every fit
        self.x = torch.randn(*self.shape, generator=g, device=self.device)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.net(self.x).float().square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


def plugin_for(name: str, device: str) -> Any:
    """``"ours <recipe>"`` -> ``lightning_ext.MixedPrecision``; ``"native <precision>"`` -> Lightning's plugin,
    as ``Trainer(precision=...)`` builds it on ``device``."""
    kind, recipe = name.split(" ", 1)
    if kind == "ours":
        return MixedPrecision(recipe, device=device)
    if recipe == "32-true":
        return Precision()
    if recipe == "16-mixed":
        return NativeMixed("16-mixed", device, torch.amp.GradScaler(device))
    return NativeMixed(recipe, device)


class _Window(pl.Callback):
    """Seconds per step over the steps after ``warmup`` (synchronised on CUDA)."""

    def __init__(self, warmup: int, device: str) -> None:
        self.warmup, self.device = warmup, device
        self.t0 = self.seconds = 0.0
        self.steps = 0

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx == self.warmup:
            cuda_sync(self.device)
            self.t0 = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx >= self.warmup:
            self.steps += 1
            cuda_sync(self.device)
            self.seconds = time.perf_counter() - self.t0


def fit(plugin: Any, module: pl.LightningModule, batches: list, device: str,
        callbacks: Iterable[Any] = ()) -> pl.Trainer:
    """``len(batches)`` steps of ``module`` under ``plugin`` on one ``device``, quiet."""
    trainer = pl.Trainer(accelerator=device, devices=1, plugins=[plugin], max_steps=len(batches), max_epochs=1,
                         callbacks=list(callbacks), logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(module, train_dataloaders=DataLoader(batches, batch_size=None))
    return trainer


def release(device: str) -> None:
    """On CUDA, free what the previous fit left (Python garbage, the allocator's cache) before the next
    one's peak is measured; nothing on the CPU (no figure there depends on it)."""
    if device == "cuda":
        gc.collect()
        torch.cuda.empty_cache()


def timed_variant(name: str, make_module: Callable[[], pl.LightningModule], batches: list, warmup: int,
                  device: str, peaks: dict[str, list[tuple[float, float]]],
                  errors: dict[str, str]) -> Callable[[], float]:
    """A variant for ``common.alternate``: one fit, its seconds per timed step.  On CUDA its peak allocated MB
    (``torch.cuda.max_memory_allocated``) and the MB still allocated when it started (what earlier fits
    left; ~0 expected) go to ``peaks[name]``.  A fit that raises gives NaN and its error in
    ``errors[name]`` (the other variants still run)."""
    def once() -> float:
        release(device)
        start = 0.0
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
            start = torch.cuda.memory_allocated() / 2**20
        window = _Window(warmup, device)
        try:
            fit(plugin_for(name, device), make_module(), batches, device, [window])
        except Exception as exc:  # noqa: BLE001 - reported in the JSON next to the figures
            errors[name] = f"{type(exc).__name__}: {exc}"[:2000]
            release(device)
            return float("nan")
        if device == "cuda":
            peaks.setdefault(name, []).append((torch.cuda.max_memory_allocated() / 2**20, start))
        if window.steps != len(batches) - warmup:
            errors[name] = f"timed {window.steps} steps, expected {len(batches) - warmup}"
            return float("nan")
        return window.seconds / window.steps
    return once


def rounds_within(variants: dict[str, Callable[[], float]], rounds: int,
                  deadline: float) -> tuple[dict[str, list[float]], int]:
    """Up to ``rounds`` rounds of ``common.alternate`` (A B C, then C B A, ...), stopping before a round
    that would end after ``deadline`` (``time.monotonic()``); at least one round runs."""
    times: dict[str, list[float]] = {n: [] for n in variants}
    items = list(variants.items())
    last = 0.0
    done = 0
    for r in range(rounds):
        start = time.monotonic()
        if r and start + last > deadline:
            break
        for n, ts in alternate(dict(items if r % 2 == 0 else items[::-1]), 1).items():
            times[n] += ts
        last = time.monotonic() - start
        done += 1
    return times, done


def forward_variant(plugin: Any, module: nn.Module, x: torch.Tensor, reps: int, device: str,
                    autocast: torch.dtype | None = None) -> Callable[[], float]:
    """Seconds per forward pass of ``module`` on ``x`` under ``torch.no_grad()``: in ``plugin.forward_context()``
    (ours, after ``plugin.convert_module``) or in ``torch.autocast(device, autocast)`` (native)."""
    def once() -> float:
        ctx = plugin.forward_context() if plugin is not None else torch.autocast(device, dtype=autocast)
        with torch.no_grad(), ctx:
            module(x)
            cuda_sync(device)
            t0 = time.perf_counter()
            for _ in range(reps):
                module(x)
            cuda_sync(device)
        return (time.perf_counter() - t0) / reps
    return once


def count_scaled_mm(fn: Callable[[], Any]) -> int:
    """How many times ``torch._scaled_mm`` ran during ``fn()`` (0 where torch has none)."""
    original = getattr(torch, "_scaled_mm", None)
    if original is None:
        fn()
        return 0
    calls = [0]

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return original(*args, **kwargs)

    torch._scaled_mm = counting
    try:
        fn()
    finally:
        torch._scaled_mm = original
    return calls[0]


def held_bytes(tensors: Iterable[Any]) -> int:
    """Bytes of the distinct storages among ``tensors`` (non-tensors skipped): a released storage counts 0,
    a view or a tied weight once."""
    seen: set[int] = set()
    total = 0
    for t in tensors:
        if isinstance(t, torch.Tensor):
            storage = t.untyped_storage()
            key = storage.data_ptr() if storage.nbytes() else id(storage)
            if key not in seen:
                seen.add(key)
                total += storage.nbytes()
    return total


def model_state(module: nn.Module, optimizer: Any, plugin: Any) -> Iterable[Any]:
    """Every tensor of model state: weights and grads, the optimizer's params (masters) and grads, its
    per-parameter states, compensation buffers (``bf16-kahan``) and FP8 scaling states."""
    for p in module.parameters():
        yield p
        yield p.grad
    for group in optimizer.param_groups:
        for p in group["params"]:
            yield p
            yield p.grad
    for state in optimizer.state.values():
        yield from (v for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0)
    rounding = getattr(plugin, "rounding", None)
    if rounding is not None:
        yield from rounding.buffers()
    fp8 = getattr(plugin, "fp8", None)
    if fp8 is not None and fp8.states:
        yield from (t for s in fp8.states.values() for t in s)


class _Held(pl.Callback):
    """Bytes held at the optimizer step (its pre and post hooks, the first two applied steps): the storages
    of the model state and, on CUDA, ``torch.cuda.memory_allocated()`` above ``base``."""

    def __init__(self, plugin: Any, device: str, base: int) -> None:
        self.plugin, self.device, self.base = plugin, device, base
        self.held = 0
        self.allocated = 0
        self._handles: list[Any] = []
        self._applied = 0

    def on_train_start(self, trainer: pl.Trainer, pl_module: Any) -> None:
        opt = trainer.optimizers[0]

        def measure(optimizer: Any, args: Any, kwargs: Any, post: bool = False) -> None:
            self.held = max(self.held, held_bytes(model_state(pl_module, optimizer, self.plugin)))
            if self.device == "cuda":
                self.allocated = max(self.allocated, torch.cuda.memory_allocated() - self.base)
            if post:
                self._applied += 1
                if self._applied >= 2:
                    for h in self._handles:
                        h.remove()

        self._handles = [opt.register_step_pre_hook(measure),
                         opt.register_step_post_hook(lambda o, a, k: measure(o, a, k, post=True))]


def warm_device(device: str) -> None:
    """Create the matmul handles and workspaces before a baseline is read (CUDA)."""
    if device != "cuda":
        return
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        a = torch.ones(64, 64, device=device, dtype=dtype, requires_grad=True)
        (a @ a).sum().backward()
    cuda_sync(device)


def bytes_per_param_row(recipe: str, template: nn.Module, batches: list, device: str) -> dict[str, Any]:
    """One recipe's model-state bytes per parameter at the optimizer step: measured (storages; CUDA: the
    allocator) and ``mp_callbacks.estimate_memory`` for the dtypes the parameters ended in."""
    release(device)
    warm_device(device)
    base = torch.cuda.memory_allocated() if device == "cuda" else 0
    plugin = MixedPrecision(recipe, device=device)
    module = LM(template)
    probe = _Held(plugin, device, base)
    fit(plugin, module, batches, device, [probe])
    params = list(module.parameters())
    n = sum(p.numel() for p in params)
    dtypes = [(p.numel(), str(p.dtype).replace("torch.", "")) for p in params]
    fp8 = plugin.fp8.nbytes if plugin.fp8 is not None else 0
    est = estimate_memory(plugin.recipe.master, "adamw", dtypes, fp32_master_grads=plugin.master_weights,
                          weights_released=plugin.master_weights and plugin.free_weights_during_step, fp8_state=fp8)
    row = {"recipe": recipe, "params": n, "held_bytes_per_param": probe.held / n,
           "estimate_bytes_per_param": est.total / n, "estimate": est.to_dict(),
           "fp32_params": sum(k for k, d in dtypes if d == "float32"),
           "allocated_bytes_per_param": probe.allocated / n if device == "cuda" else None,
           "fp8_matmuls": list(plugin.fp8.names) if plugin.fp8 is not None else None}
    del module, plugin, probe
    release(device)
    return row


def linear_forward_rows(s: Sizes, device: str, reps: int, rounds: int, deadline: float) -> dict[str, Any]:
    """Forward passes only (no grad) of the Linear stack: ours fp8-mixed and bf16-mixed (plugin's
    ``convert_module`` + ``forward_context``) and native bf16 autocast; ``torch._scaled_mm`` calls counted."""
    torch.manual_seed(0)
    x = torch.randn(s.linear_tokens, s.linear_dim).to(device)
    variants, plugins, calls = {}, [], {}
    for name in ("ours fp8-mixed", "ours bf16-mixed", "native bf16-mixed"):
        module = LinearStack(s.linear_dim, s.linear_depth, s.linear_tokens).net.to(device)
        plugin = None
        if name.startswith("ours"):
            plugin = plugin_for(name, device)
            plugin.convert_module(module)
            plugins.append(plugin)
        variants[f"{name} forward"] = fn = forward_variant(plugin, module, x, reps, device, torch.bfloat16)
        calls[f"{name} forward"] = count_scaled_mm(fn) / (reps + 1)
    variants["native bf16-mixed forward (control)"] = variants["native bf16-mixed forward"]
    times, done = rounds_within(variants, rounds, deadline)
    for plugin in plugins:
        plugin.teardown()
    return {"times": times, "rounds": done, "scaled_mm_calls_per_forward": calls}
