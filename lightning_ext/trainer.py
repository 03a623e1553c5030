"""``lightning_ext.MixedPrecision``: the core's recipes as a Lightning Trainer precision plugin.

A drop-in for Lightning's ``MixedPrecision``.  The logic is the Fabric plugin's
(:class:`lightning_ext.fabric.MixedPrecision`); this class is a thin subclass of
Lightning's Trainer ``Precision`` and of it, in that order (Lightning's own
``TransformerEnginePrecision`` pattern: the Trainer's ``backward``,
``post_backward`` and closure machinery come first, the Fabric plugin supplies
the rest).  What only the Trainer has lives here: the model from
``module.trainer``, ``connect`` (the weight store around the optimizers, the DDP
comm hook, the LR schedulers held on skipped steps: :mod:`~lightning_ext.loss_scale.schedulers`),
the loss scaled in ``pre_backward`` (the hooks see the scaled loss, as native),
the closure step, ``clip_gradients`` and the checkpoint's FP32 weights.

One optimizer step, as Lightning's own ``MixedPrecision.optimizer_step``: the
closure runs the backward of ``loss * scale``; the gradients are unscaled and
checked (under ``*-master`` on the FP32 masters); hooks and clipping see
unscaled FP32 gradients; the optimizer steps unless the gradients are not finite
(a skipped step changes no parameter, master, optimizer state, step count or
step-interval schedule); the scale is updated.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from typing import Any

import lightning.pytorch as pl
from lightning.fabric.plugins.precision import Precision as FabricPrecision
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities import GradClipAlgorithmType
from torch import Tensor, nn
from torch.optim import LBFGS, Optimizer

from .checkpoint import PLUGIN_SCHEMA, PLUGIN_SCHEMA_VERSION
from .checkpoint.record import masters_as_weights, missing_state_warning
from .distributed import register_comm_hook
from .fabric import MixedPrecision as FabricMixedPrecision
from .loss_scale import ExternalScaler, hold_schedulers, unwrap_optimizer
from .loss_scale.external import optimizer_unscales_in_step
from .support import autocast_device, check_optimizer, check_strategy, is_sharded

__all__ = ["MixedPrecision", "PLUGIN_SCHEMA", "PLUGIN_SCHEMA_VERSION"]


class MixedPrecision(Precision, FabricMixedPrecision):
    """Mixed-precision training for the Lightning Trainer driven by the :mod:`mp_callbacks` core.

    Takes the arguments of :class:`lightning_ext.fabric.MixedPrecision` (``precision``, ``device``,
    ``scaler``, ``policy``, ``count_overflows``, ``free_weights_during_step``, ``allow_recipe_change``,
    ``divergence``, ``state_dtype``, ``seed``, ``comm_dtype``, ``fp8``, ``restore_forward_state``,
    ``master_remainders``).
    """

    # ---------------------------------------------------------- module / setup
    def convert_module(self, module: nn.Module) -> nn.Module:
        """Check the Trainer's strategy (autocast follows its device), then apply the recipe to the model:
        parameter storage (``*-master``, ``bf16-kahan``/``-sr``), FP32-op hooks, FP8 matmuls; under
        ``ModelParallelStrategy`` (FSDP2) the model is sharded already and its FP32 shards stay the masters."""
        strategy = _trainer_of(module).strategy if _trainer_of(module) is not None else None
        if strategy is not None:
            check_strategy(strategy)
            if self.recipe.low_precision:
                self._device_type = autocast_device(strategy, self.device, self._device_type)
        self._root = module
        self._apply_recipe(module, sharded=strategy is not None and is_sharded(strategy))
        return module

    def connect(
        self, model: nn.Module, optimizers: list[Optimizer], lr_schedulers: list[Any]
    ) -> tuple[nn.Module, list[Optimizer], list[Any]]:
        """Check the optimizers, install FP32 masters or update rounding, register the DDP communication hook;
        under automatic optimization the step-interval LR schedulers come back held on skipped steps
        (:func:`~lightning_ext.loss_scale.schedulers.hold_schedulers`)."""
        raws = [unwrap_optimizer(o) for o in optimizers]
        for raw in raws:
            check_optimizer(raw, self.recipe.name)
        self._install(self._root if self._root is not None else model, raws)
        register_comm_hook(model, self.recipe.comm_dtype, self.comm_counter)
        if getattr(self._root, "automatic_optimization", False):
            lr_schedulers = hold_schedulers(lr_schedulers, self.last_step_skipped)
        return model, optimizers, lr_schedulers

    def convert_input(self, data: Any) -> Any:
        """Batches are left as they are (Lightning's Trainer AMP does not cast them either)."""
        return data

    def convert_output(self, data: Any) -> Any:
        """Outputs are left as they are (as under Lightning's Trainer AMP)."""
        return data

    # ----------------------------------------------------------------- steps
    def pre_backward(self, tensor: Tensor, module: Any) -> Tensor:  # type: ignore[override]
        """Multiply the loss by the current scale (when scaling is enabled), then run the hooks."""
        if module is None:  # Fabric's backward: this is the Trainer's plugin (Lightning's own fails on .trainer)
            raise TypeError("lightning_ext.MixedPrecision is the Trainer's precision plugin; with Fabric use "
                            "lightning_ext.fabric.MixedPrecision (the same arguments)")
        self.loss_scaler.to(tensor.device)
        return super().pre_backward(self.loss_scaler.scale(tensor), module)

    def optimizer_step(  # type: ignore[override]
        self, optimizer: Any, model: Any, closure: Callable[[], Any], **kwargs: Any
    ) -> Any:
        """Run the closure, unscale and check, then step (or skip) the optimizer and update the scale."""
        raw = unwrap_optimizer(optimizer)
        if isinstance(raw, LBFGS):
            if self.recipe.name == "32-true":
                return super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)
            check_optimizer(raw, self.recipe.name)  # raises
        closure_result = closure()
        if closure_result is None and getattr(model, "automatic_optimization", True):
            self._after_closure(model, raw)  # training_step returned None: no backward, no update
            self._abandon_step(raw)
            return None
        self._unscale(raw)
        self._after_closure(model, raw)  # hooks and clipping: unscaled FP32 gradients
        return self._step_and_update(raw, **kwargs)

    def unscale_gradients(self, optimizer: Any) -> Tensor | None:
        """Unscale (under ``*-master``: onto the masters) ``optimizer``'s gradients; returns ``found_inf``.
        A second call before the step returns the first result (manual optimization may call it)."""
        return self._unscale(unwrap_optimizer(optimizer))

    def main_params(self, optimizer: Optimizer) -> Iterator[nn.Parameter]:
        """What clipping sees: every parameter of the optimizer (its masters under ``*-master``)."""
        return FabricPrecision.main_params(self, optimizer)

    def clip_gradients(
        self, optimizer: Optimizer, clip_val: int | float = 0.0,
        gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM,
    ) -> None:
        """Clip the unscaled FP32 (master) gradients; unscales first when not done yet (manual optimization)."""
        if clip_val and clip_val > 0:
            if isinstance(self.loss_scaler, ExternalScaler) and optimizer_unscales_in_step(optimizer):
                raise RuntimeError(
                    f"The current optimizer, {type(optimizer).__qualname__}, does not allow for gradient clipping with "
                    "an external scaler: it unscales its gradients inside step(), after clipping would run. Use the "
                    "plugin's own scaler (it unscales before clipping) or another optimizer.")
            self._unscale(unwrap_optimizer(optimizer))
        super().clip_gradients(unwrap_optimizer(optimizer), clip_val, gradient_clip_algorithm)

    # ------------------------------------------------------------ checkpoints
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """The checkpoint's model weights are the FP32 masters (``*-master``): what an FP32 model loads."""
        masters_as_weights(self.masters, checkpoint)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """A checkpoint without the plugin's state (a run without it): that state starts fresh, with a warning."""
        if type(self).__qualname__ not in checkpoint:
            warnings.warn(missing_state_warning(self._ckpt_path(), self.recipe), stacklevel=2)

    def _ckpt_path(self, state_dict: Any = None) -> Any:
        """The file the Trainer resumes from (the Fabric plugin's ``load_state_dict`` names it in an error)."""
        trainer = _trainer_of(self.root_module)
        return getattr(trainer, "ckpt_path", None)


def _trainer_of(module: Any) -> Any:
    """The Trainer a LightningModule is attached to (its public ``trainer``), else None."""
    if not isinstance(module, pl.LightningModule):
        return None
    try:
        return module.trainer
    except RuntimeError:  # not attached to a Trainer
        return None
