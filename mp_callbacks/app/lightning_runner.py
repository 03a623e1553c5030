"""Lightning runner of ``mpx compare``: one recipe, the shared :class:`RunSpec`.

The model is an MLP (``depth`` hidden layers of ``hidden`` units, ReLU) on
scikit-learn's digits, trained with AdamW through ``Trainer`` and
:class:`lightning_ext.MixedPrecision`.  The loss is the weighted mean
cross-entropy ``sum(l * w) / batch`` with the spec's sample weights, so an
injected ``inf`` weight overflows the step exactly as in the Keras runner.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

from lightning_ext.diagnostics import held_tensors
from lightning_ext.trainer import MixedPrecision

from ..diagnostics import History, StepStats
from ..memory import estimate_memory
from ..recipes import get_recipe, recipe_label
from .compare import (
    RunResult,
    RunSpec,
    accuracy_metric,
    batch_indices,
    digits_data,
    sample_weights,
    scaler_for,
    timing_fields,
)
from .fp8_report import FP8_SAMPLE_EVERY
from .measurement import PeakRSS
from .run_stats import loss_tail

__all__ = ["fit_once", "mlp", "run", "state_bytes"]


def mlp(hidden: int, depth: int) -> nn.Sequential:
    """64 -> ``depth`` x (Linear(hidden), ReLU) -> 10."""
    layers: list[nn.Module] = []
    width = 64
    for _ in range(depth):
        layers += [nn.Linear(width, hidden), nn.ReLU()]
        width = hidden
    layers.append(nn.Linear(width, 10))
    return nn.Sequential(*layers)


OptimizerFactory = Callable[[Any, float], torch.optim.Optimizer]
"""``(parameters, lr) -> optimizer``: what the runner's module trains with (default: ``AdamW(params, lr)``)."""


class _Module(pl.LightningModule):
    def __init__(self, net: nn.Module, lr: float, optimizer: OptimizerFactory | None = None) -> None:
        super().__init__()
        self.net, self.lr, self.make_optimizer = net, lr, optimizer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y, w = batch
        losses = F.cross_entropy(self(x).float(), y, reduction="none")
        return (losses * w).sum() / w.shape[0]

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.make_optimizer is not None:
            return self.make_optimizer(self.parameters(), self.lr)
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


def state_bytes(module: nn.Module, optimizer: torch.optim.Optimizer, extra: Any = ()) -> int:
    """Bytes of model state held right now: params, grads, FP32 masters, optimizer state, and the
    tensors in ``extra`` (``plugin.rounding.buffers()``: ``bf16-kahan``'s compensation buffers).

    Counts the memory actually allocated: each distinct storage once, at its
    current size (a weight whose storage is released during the optimizer step
    counts 0), so views and tied weights are not counted twice.
    """
    seen: set[int] = set()
    total = 0

    def add(t: Any) -> None:
        nonlocal total
        if isinstance(t, torch.Tensor) and type(t) not in (torch.Tensor, nn.Parameter):
            for inner in held_tensors(t):  # a tensor subclass (torchao's quantized states): its inner tensors
                add(inner)
        elif isinstance(t, torch.Tensor):
            storage = t.untyped_storage()
            key = storage.data_ptr() if storage.nbytes() else id(storage)
            if key not in seen:
                seen.add(key)
                total += storage.nbytes()

    for p in module.parameters():
        add(p)
        add(p.grad)
    for group in optimizer.param_groups:
        for p in group["params"]:
            add(p)
            add(p.grad)
    for state in optimizer.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor) and v.dim() > 0:  # 0-d step counters are not per-param state
                add(v)
    for t in extra:
        add(t)
    return total


class _Batches(Dataset):
    """Precomputed batches, served in order (``DataLoader(batch_size=None)``)."""

    def __init__(self, batches: list[tuple[torch.Tensor, ...]]) -> None:
        self.batches = batches

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, ...]:
        return self.batches[i]


class _Recorder(pl.Callback):
    """Per-step wall time, loss, scale and overflow flag; model-state bytes at the optimizer step.

    ``state_bytes``: the most held when ``optimizer.step()`` starts and when it ends (pre/post step
    hooks), over the first ``MEASURED_STEPS`` steps the optimizer applies: from the end of the first
    one the optimizer state exists (AdamW creates m and v there); ``bf16-kahan``/``bf16-sr`` hold
    most at the start (their bf16 gradients are spent inside the step).  None: no step was applied.
    The hooks are removed once measured, so later steps run without them.
    """

    MEASURED_STEPS = 2

    def __init__(self, plugin: Any, steps: int, progress: Callable[[int], None] | None) -> None:
        self.plugin, self.steps, self.progress = plugin, steps, progress
        self.record = isinstance(plugin, MixedPrecision)  # native plugins: times only
        self.times: list[float] = []
        self.cpu_times: list[float] = []  # process CPU time per step (robust to other jobs on the machine)
        self.history = History()
        self.state_bytes: int | None = None
        self._t0 = self._c0 = 0.0
        self._hooks: list[Any] = []

    clocked = False  # True when a _Clock placed before other callbacks starts the step's timer

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if not self.clocked:
            self._t0, self._c0 = time.perf_counter(), time.process_time()
        fp8 = getattr(self.plugin, "fp8", None)
        if fp8 is not None and batch_idx % FP8_SAMPLE_EVERY == 0:  # fp8-mixed: count saturated/flushed elements
            fp8.measure = True

    def timed(self) -> list[float]:
        """Step times without the first 10% (warm-up)."""
        return self.times[max(1, len(self.times) // 10):] or self.times

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self.record:
            return
        raw = getattr(trainer.optimizers[0], "_optimizer", trainer.optimizers[0])
        applied: list[int] = []

        def measure(optimizer: Any) -> None:
            rounding = getattr(self.plugin, "rounding", None)
            held = state_bytes(pl_module, optimizer, rounding.buffers() if rounding else ())
            self.state_bytes = max(held, self.state_bytes or 0)

        def pre(optimizer: Any, args: Any, kwargs: Any) -> None:
            measure(optimizer)

        def post(optimizer: Any, args: Any, kwargs: Any) -> None:
            measure(optimizer)
            applied.append(1)
            if len(applied) >= self.MEASURED_STEPS:
                self._remove_hooks()

        self._hooks = [raw.register_step_pre_hook(pre), raw.register_step_post_hook(post)]

    def _remove_hooks(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._remove_hooks()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.times.append(time.perf_counter() - self._t0)
        self.cpu_times.append(time.process_time() - self._c0)
        if not self.record:
            if self.progress:
                self.progress(batch_idx + 1)
            return
        view = self.plugin.scaler
        stats = self.plugin.latest_stats()
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.history.append(StepStats(
            step=batch_idx, scale=float(stats["scale"]) if stats else 1.0,
            overflow=bool(stats["overflow"]) if stats else False,
            overflows_total=view.overflows if view else 0, skipped_total=view.skipped if view else 0,
            growths_total=view.growths if view else 0,
            loss=float(loss.detach()) if loss is not None else None,
            fp8=self.plugin.fp8.host_metrics() if self.plugin.fp8 is not None and batch_idx % FP8_SAMPLE_EVERY == 0
            else None,
        ))
        if self.progress:
            self.progress(batch_idx + 1)


class _Clock(pl.Callback):
    """Starts the recorder's step timer before every other callback's ``on_train_batch_start``."""

    def __init__(self, recorder: _Recorder) -> None:
        self.recorder = recorder
        recorder.clocked = True

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self.recorder._t0, self.recorder._c0 = time.perf_counter(), time.process_time()


def fit_once(plugin: Any, spec: RunSpec, progress: Callable[[int], None] | None = None,
             callbacks: Sequence[pl.Callback] = (), optimizer: OptimizerFactory | None = None,
             ) -> tuple[_Module, _Recorder]:
    """Train the spec's MLP once with ``plugin`` (ours or a native Lightning precision plugin).

    ``callbacks`` (e.g. a ``MixedPrecisionMonitor`` to benchmark) run inside the timed step:
    the timer starts before their ``on_train_batch_start`` and stops after their
    ``on_train_batch_end``.  ``optimizer``: ``(parameters, lr) -> optimizer`` instead of
    ``torch.optim.AdamW(parameters, lr=lr)``."""
    if spec.threads:
        torch.set_num_threads(spec.threads)
    pl.seed_everything(spec.seed, verbose=False)
    x_tr, y_tr, _, _ = digits_data(spec.seed)
    idx = batch_indices(len(x_tr), spec)
    weights = sample_weights(spec)
    batches = [(torch.from_numpy(x_tr[i]), torch.from_numpy(y_tr[i]), torch.from_numpy(weights[s]))
               for s, i in enumerate(idx)]
    module = _Module(mlp(spec.hidden, spec.depth), spec.lr, optimizer)
    recorder = _Recorder(plugin, spec.steps, progress)
    timed = [_Clock(recorder), *callbacks, recorder] if callbacks else [recorder]
    trainer = pl.Trainer(accelerator="cpu", devices=1, plugins=[plugin], max_steps=spec.steps, max_epochs=1,
                         callbacks=timed, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(module, train_dataloaders=DataLoader(_Batches(batches), batch_size=None))
    return module, recorder


def run(recipe: str, spec: RunSpec, progress: Callable[[int], None] | None = None) -> RunResult:
    """Train ``spec`` under ``recipe`` and measure it."""
    # The output layer runs in FP32, as keras_ext.apply_policy does for the layer producing the
    # model output (torch has no notion of "the output module": a rule names it).
    chosen = get_recipe(recipe)  # a label (fp8-mixed[rowwise], bf16-sr[state_dtype=bfloat16]) carries its settings
    policy = chosen.policy.with_fp32_modules(f"net.{2 * spec.depth}")
    plugin = MixedPrecision(chosen.name, "cpu", scaler=scaler_for(recipe, spec), policy=policy, fp8=chosen.fp8,
                            state_dtype=chosen.master.state_dtype, master_remainders=chosen.master.master_remainders,
                            count_overflows=True)
    with PeakRSS() as rss:
        module, recorder = fit_once(plugin, spec, progress)
    _, _, x_te, y_te = digits_data(spec.seed)
    module.eval()
    with torch.no_grad(), plugin.forward_context():
        logits = module(torch.from_numpy(x_te)).float()
        accuracy = float((logits.argmax(-1).numpy() == y_te).mean())
    n_params = sum(p.numel() for p in module.parameters())
    storage = [(p.numel(), str(p.dtype).replace("torch.", "")) for p in module.parameters()]
    estimate = estimate_memory(chosen.master, "adamw", storage, fp32_master_grads=True,
                               weights_released=plugin.free_weights_during_step)
    tail = loss_tail(recorder.history)
    view = plugin.scaler
    return RunResult(
        framework="lightning", recipe=recipe_label(recipe), params=n_params,
        **timing_fields(recorder.times, spec.batch_size), peak_rss_mb=rss.peak_mb,
        state_bytes_per_param=None if recorder.state_bytes is None else recorder.state_bytes / n_params,
        estimate_bytes_per_param=estimate.bytes_per_param,
        final_loss=float(np.mean(tail)), accuracy=accuracy, **accuracy_metric(accuracy, len(y_te)),
        overflows=view.overflows, skipped=view.skipped, history=recorder.history,
    )
