"""Putting a recipe on the model and the weight store around the optimizers (Fabric and Trainer plugins).

:class:`RecipeSetup` is the part of :class:`lightning_ext.fabric.MixedPrecision` that runs at set-up
and teardown; the step protocol and checkpoints stay in the plugin.  The rules:

* ``convert_module`` applies the recipe (parameter storage, FP32-op hooks, FP8 matmuls) at once, except
  under ``ModelParallelStrategy`` (FSDP2), where it waits until the strategy has sharded the model
  (the FP32 shards then stay the masters);
* the weight store goes around each optimizer as the strategy sets it up (before any ``fabric.load``);
  an optimizer no set-up showed gets it at its first step, with one warning;
* ``teardown`` removes hooks, FP8 matmuls and the set-up watch; masters and scaler state are kept.

It uses the plugin's ``recipe``, ``weight_store``, ``fp8``, ``comm_counter``, ``keep_in_fp32`` and the
set-up fields ``__init__`` makes (``_root``, ``_watched``, ``_optimizers``, ``_policy_handle``...).
"""

from __future__ import annotations

import warnings
from typing import Any

from torch import nn
from torch.optim import Optimizer

from mp_callbacks.advice import cpu_flags, cpu_float16_notice

from .distributed import register_comm_hook
from .fsdp import inspect_sharded
from .low_bit import EightBitAdamW, plain_state_checkpoints
from .policy import apply_module_policy, cast_module_storage
from .scaler import unwrap_optimizer
from .support import (
    autocast_device,
    check_optimizer,
    check_strategy,
    is_sharded,
    unwatch_fabric_setup,
    watch_fabric_setup,
)

__all__ = ["RecipeSetup"]


class RecipeSetup:
    """Set-up and teardown of :class:`lightning_ext.fabric.MixedPrecision` (a base class of it, not used alone)."""

    recipe: Any
    weight_store: Any
    fp8: Any
    comm_counter: Any
    pending_fp32_paths: list[str]

    def convert_module(self, module: nn.Module) -> nn.Module:
        """Apply the recipe to the model (under FSDP2 once it is sharded) and watch the calling Fabric's setup."""
        strategy = watch_fabric_setup(self._after_setup_module, self._after_setup_optimizer)
        self._check_strategy(strategy)
        self._root = module
        if strategy is not None:
            self._watched = strategy
        if strategy is None or not is_sharded(strategy):  # ModelParallelStrategy shards after this call
            self._apply_recipe(module, sharded=False)
        return module

    def _check_strategy(self, strategy: Any) -> None:
        """Refuse what the plugin cannot train with; autocast follows the training device."""
        if strategy is None:
            return
        check_strategy(strategy)
        if self.recipe.low_precision:
            self._device_type = autocast_device(strategy, self.device, self._device_type)

    def _apply_recipe(self, module: nn.Module, sharded: bool) -> None:
        """Parameter storage (``*-master``, ``bf16-kahan``/``-sr``; sharded: the FP32 shards stay the masters),
        FP32-op hooks, FP8 matmuls."""
        if not self._noticed:  # once per plugin, at setup: the device is known now
            self._noticed = True
            notice = cpu_float16_notice(self.recipe.name, self.recipe.policy.compute, self._device_type, cpu_flags())
            if notice is not None:
                warnings.warn(f"lightning_ext.MixedPrecision: {notice}", UserWarning, stacklevel=3)
        self.sharded = inspect_sharded(module, self.recipe) if sharded else None
        store = self.weight_store
        if store is not None and self.sharded is None:
            store.record_originals(module, cast_module_storage(module, self.policy, self.compute_dtype))
        if self.recipe.low_precision and self._hooked_module is not module:
            if self._policy_handle is not None:
                self._policy_handle.remove()
            self._policy_handle = apply_module_policy(module, self.policy, self._device_type)
            self._hooked_module = module
        if self.fp8 is not None:
            self.fp8.install(module, self.policy)

    def _after_setup_module(self, module: nn.Module) -> None:
        """After the strategy wrapped or sharded the model: the recipe on a sharded one, the DDP comm hook."""
        if self._watched is not None and is_sharded(self._watched):
            self._root = module
            self._apply_recipe(module, sharded=True)
        register_comm_hook(module, self.recipe.comm_dtype, self.comm_counter)

    def _after_setup_optimizer(self, optimizer: Optimizer) -> None:
        """An optimizer set up by the strategy: the weight store goes around it now (before any load)."""
        raw = unwrap_optimizer(optimizer)
        check_optimizer(raw, self.recipe.name)
        if not any(raw is o for o in self._optimizers):
            self._install(self._root, [*self._optimizers, raw])

    def _install(self, root: nn.Module | None, optimizers: list[Optimizer]) -> None:
        """Put the weight store around ``optimizers`` (all of them: rounding re-installs whole), then apply
        FP32 moves that waited for the masters.  Under FSDP2 masters are not installed (the shards are).
        Under ``state_dtype="8bit"`` each optimizer gets its 8-bit update
        (:class:`~lightning_ext.low_bit.EightBitAdamW`); torchao optimizers save quantized states as plain data."""
        for opt in optimizers:
            if type(opt).__module__.startswith("torchao.optim"):
                plain_state_checkpoints(opt)
            elif self.recipe.master.quantized_states:
                known = self._low_bit.get(id(opt))
                if known is None or known.optimizer is not opt:
                    self._low_bit[id(opt)] = EightBitAdamW(opt)
        self._optimizers = list(optimizers)
        store = self.weight_store
        if store is None or root is None or (self.sharded is not None and store.keeps_masters):
            return
        store.install(root, self._optimizers)
        if store.keeps_masters:
            for path in self.pending_fp32_paths:
                self.keep_in_fp32(path)
            self.pending_fp32_paths = []

    def _ensure_installed(self, optimizer: Any) -> Any:
        """The raw optimizer, with the weight store around it: installed now (with a one-time warning) when
        no Fabric setup showed it to this plugin."""
        raw = unwrap_optimizer(optimizer)
        if any(raw is o for o in self._optimizers):
            return raw
        check_optimizer(raw, self.recipe.name)
        if self.weight_store is not None and self._root is not None and not self._warned_lazy:
            self._warned_lazy = True
            warnings.warn(
                f"lightning_ext MixedPrecision({self.recipe.name!r}): no Fabric setup showed this optimizer to the "
                "plugin, so its FP32 masters / update rounding are installed at its first step; optimizer state "
                "loaded before then was cast to the parameters' low-precision dtype. Set the model and optimizer up "
                "with fabric.setup(model, optimizer) (or setup_module + setup_optimizers) before fabric.load.",
                stacklevel=4)
        self._install(self._root, [*self._optimizers, raw])
        return raw

    # --------------------------------------------------------------- teardown
    def teardown(self) -> None:
        """Remove the op-policy hooks, FP8 matmuls and the setup watch; keep masters and scaler state."""
        if self._policy_handle is not None:
            self._policy_handle.remove()
            self._policy_handle = None
        self._hooked_module = None
        if self.fp8 is not None:
            self.fp8.remove()
        self._root = None
        if self.weight_store is not None:
            self.weight_store.clear_cache()
        if self._watched is not None:
            unwatch_fabric_setup(self._watched)
            self._watched = None
