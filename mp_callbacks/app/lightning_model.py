"""Lightning side of ``mpx compare --lightning``: the user's ``LightningModule`` under one recipe.

:func:`prepare` (once, in a child process): the module built by the factory (seeded, FP32), its
``state_dict`` as the initial weights, the first ``steps`` training batches of the datamodule's (or the
module's own) ``train_dataloader`` and up to ``val_batches`` validation batches.  :func:`run` (once per
recipe, in a process of its own): a fresh module from the factory with those weights loaded, trained
by ``Trainer`` with :class:`lightning_ext.MixedPrecision` on the prepared batches in order, with
:class:`lightning_ext.MixedPrecisionMonitor` sampling the diagnostics, then validated on the prepared
validation batches (the metric the module logs in ``validation_step``).  Any exception becomes a
failed :class:`~mp_callbacks.app.compare.RunResult`.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from torch.utils.data import DataLoader

from lightning_ext import MixedPrecision, MixedPrecisionMonitor

from ..recipes import get_recipe, recipe_label
from ..recommend import higher_is_better
from .compare import ModelSetupError, ModelSpec, PreparedData, RunResult, optimizer_label, timing_fields
from .lightning_runner import _Batches, _Clock, _Recorder
from .measurement import PeakRSS, error_summary
from .run_stats import estimate_per_param, loss_tail, run_diagnostics, standard_error

__all__ = ["prepare", "run"]


def _overrides(module: pl.LightningModule, hook: str) -> bool:
    return getattr(type(module), hook, None) is not getattr(pl.LightningModule, hook)


def _take(loader: Any, n: int, cycle: bool) -> list[Any]:
    """The first ``n`` batches of ``loader`` (iterated again when it has fewer and ``cycle``)."""
    batches: list[Any] = []
    while len(batches) < n:
        before = len(batches)
        for batch in loader:
            batches.append(batch)
            if len(batches) == n:
                break
        if len(batches) == before or not cycle:
            break
    return batches


def batch_size_of(batch: Any) -> int:
    """The leading size of the first tensor in ``batch`` (a tensor, or tuples/lists/dicts of them)."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else 1
    items = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (list, tuple)) else ()
    for item in items:
        size = batch_size_of(item)
        if size:
            return size
    return 0


def _loaders(module: pl.LightningModule, datamodule: Any) -> tuple[Any, Any]:
    """``(train loader, validation loader or None)`` of the datamodule, else of the module itself."""
    source = datamodule if datamodule is not None else module
    if datamodule is not None:
        datamodule.prepare_data()
        datamodule.setup("fit")
    if not _overrides(source, "train_dataloader") and not hasattr(type(source), "train_dataloader"):
        raise ModelSetupError(f"{type(source).__name__} has no train_dataloader: pass --datamodule")
    try:
        train = source.train_dataloader()
    except Exception as exc:  # noqa: BLE001 - Lightning's default hook raises when it is not implemented
        raise ModelSetupError(f"{type(source).__name__}.train_dataloader(): {error_summary(exc)}; "
                              "give a datamodule") from exc
    val = None
    if _overrides(module, "validation_step"):
        try:
            val = source.val_dataloader()
        except Exception:  # noqa: BLE001 - no validation loader: the training loss is the metric
            val = None
    return train, val


def prepare(make_module: Callable[[], Any], make_datamodule: Callable[[], Any] | None, spec: ModelSpec,
            progress: Any = None) -> PreparedData:
    """The initial weights and the batches every run shares (see the module docstring)."""
    pl.seed_everything(spec.seed, verbose=False)
    module = make_module()
    if not isinstance(module, pl.LightningModule):
        raise ModelSetupError(f"{spec.model} returned a {type(module).__name__!r} object, not a LightningModule")
    datamodule = make_datamodule() if make_datamodule is not None else None
    if datamodule is not None and not isinstance(datamodule, pl.LightningDataModule):
        raise ModelSetupError(f"{spec.data} returned a {type(datamodule).__name__!r} object, not a LightningDataModule")
    train_loader, val_loader = _loaders(module, datamodule)
    train = _take(train_loader, spec.steps, cycle=True)
    if len(train) < spec.steps:
        raise ModelSetupError(f"the train_dataloader gave {len(train)} batches; {spec.steps} steps need more")
    val = _take(val_loader, spec.val_batches, cycle=False) if val_loader is not None else []
    params = sum(p.numel() for p in module.parameters())
    metric = (spec.metric or "the first validation metric with 'loss' in its name") if val else "training loss"
    return PreparedData(
        description=f"{type(module).__name__} ({params:,} parameters)",
        initial={k: v.detach().clone() for k, v in module.state_dict().items()},
        train=train, val=val, batch_size=batch_size_of(train[0]), metric_label=metric)


class _LogCapture:
    """Wraps ``module.log`` to keep every value logged while validating (per batch, for the standard error)."""

    def __init__(self, module: pl.LightningModule) -> None:
        self.values: dict[str, list[float]] = {}
        self.module, self.original = module, module.log

        def log(name: str, value: Any, *args: Any, **kwargs: Any) -> Any:
            trainer = module._trainer
            if trainer is not None and trainer.validating:
                try:
                    self.values.setdefault(name, []).append(float(value))
                except (TypeError, ValueError):
                    pass
            return self.original(name, value, *args, **kwargs)

        module.log = log  # type: ignore[method-assign]


def _pick_metric(names: list[str], wanted: str | None) -> str:
    if wanted is not None:
        if wanted not in names:
            raise ModelSetupError(f"metric {wanted!r} was not logged in validation_step; logged: {names}")
        return wanted
    return next((n for n in names if "loss" in n.lower()), names[0])


def run(recipe: str, make_module: Callable[[], Any], prepared: PreparedData, spec: ModelSpec,
        progress: Callable[[int], None] | None = None) -> RunResult:
    """Train the prepared module under ``recipe`` and measure it; a failure is a failed result."""
    try:
        return _run(recipe, make_module, prepared, spec, progress)
    except Exception as exc:  # noqa: BLE001 - a failed run is a row of the report
        return RunResult.failure("lightning", recipe_label(recipe), error_summary(exc), traceback.format_exc())


def _run(recipe: str, make_module: Callable[[], Any], prepared: PreparedData, spec: ModelSpec,
         progress: Callable[[int], None] | None) -> RunResult:
    if spec.threads:
        torch.set_num_threads(spec.threads)
    chosen = get_recipe(recipe)  # a label (fp8-mixed[rowwise], bf16-sr[state_dtype=bfloat16]) carries its settings
    name = chosen.name
    pl.seed_everything(spec.seed, verbose=False)
    module = make_module()
    module.load_state_dict(prepared.initial)
    plugin = MixedPrecision(name, "cpu", count_overflows=True, fp8=chosen.fp8, state_dtype=chosen.master.state_dtype,
                            master_remainders=chosen.master.master_remainders)
    every = spec.sample_every
    monitor = MixedPrecisionMonitor(log_every_n_steps=every, log_memory=False)
    recorder = _Recorder(plugin, spec.steps, progress)
    trainer = pl.Trainer(accelerator="cpu", devices=1, plugins=[plugin], max_steps=spec.steps, max_epochs=1,
                         callbacks=[_Clock(recorder), monitor, recorder], logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                         limit_val_batches=0)
    with PeakRSS() as rss:
        trainer.fit(module, train_dataloaders=DataLoader(_Batches(prepared.train), batch_size=None))
    tail = loss_tail(recorder.history)
    metric_name, metric, metric_se = "loss", float(np.mean(tail)), standard_error(tail)
    if prepared.val:
        capture = _LogCapture(module)
        trainer.limit_val_batches = len(prepared.val)
        logged = trainer.validate(module, dataloaders=DataLoader(_Batches(prepared.val), batch_size=None),
                                  verbose=False)
        names = sorted(logged[0]) if logged and logged[0] else []
        if names:
            metric_name = _pick_metric(names, spec.metric)
            metric, metric_se = float(logged[0][metric_name]), standard_error(capture.values.get(metric_name, []))
    higher = spec.higher_is_better if spec.higher_is_better is not None else bool(higher_is_better(metric_name))
    raw = getattr(trainer.optimizers[0], "_optimizer", trainer.optimizers[0])
    n_params = sum(p.numel() for p in module.parameters())
    storage = [(p.numel(), str(p.dtype).replace("torch.", "")) for p in module.parameters()]
    momentum = raw.param_groups[0].get("momentum", 0) if raw.param_groups else 0
    estimate = estimate_per_param(name, type(raw).__name__, momentum, storage, fp32_master_grads=True,
                                  weights_released=plugin.free_weights_during_step)
    times = [t for b, t in enumerate(recorder.times) if (b + 1) % every] or recorder.times  # monitor steps out
    view = plugin.loss_scaler
    schedulers = [type(c.scheduler).__name__ for c in trainer.lr_scheduler_configs]
    used = optimizer_label(type(raw).__name__, [g.get("initial_lr", g["lr"]) for g in raw.param_groups],
                           ", ".join(schedulers) or None)
    return RunResult(
        framework="lightning", recipe=recipe_label(recipe), params=n_params,
        **timing_fields(times, prepared.batch_size),
        peak_rss_mb=rss.peak_mb,
        state_bytes_per_param=None if recorder.state_bytes is None else recorder.state_bytes / n_params,
        estimate_bytes_per_param=estimate, final_loss=float(np.mean(tail)), accuracy=float("nan"),
        overflows=view.overflows, skipped=view.skipped, history=recorder.history, metric_name=metric_name,
        metric=metric, metric_se=metric_se, higher_is_better=higher,
        diagnostics=run_diagnostics(monitor.history, recorder.history, storage), optimizer=used,
    )
