"""Putting a recipe on the model and the weight store around the optimizers (Fabric and Trainer plugins).

:class:`RecipeSetup` is the part of :class:`lightning_ext.fabric.MixedPrecision` that runs at set-up
and teardown; the step protocol and checkpoints stay in the plugin.  The rules:

* ``convert_module`` applies the recipe at once (parameter storage, FP32-op hooks, FP8 matmuls); the
  Trainer plugin first asks its strategy whether the model will be sharded (``ModelParallelStrategy``,
  FSDP2: the recipe then waits until the strategy has sharded the model, whose FP32 shards stay the
  masters).  Fabric shows a precision plugin neither its strategy nor the optimizers, so under Fabric:

  - a model that the strategy shards (``ModelParallelStrategy``): pass the plugin to
    :func:`~lightning_ext.distributed.fully_shard_model` in the ``parallelize_fn`` (or call :meth:`prepare_sharding`
    before ``fully_shard``), which gives the parameters back their FP32 values; the sharded recipe goes on
    at the first forward;
  - DDP: the ``DistributedDataParallel`` that adopts the model is noted
    (:class:`~lightning_ext.distributed.DDPWatch`) and gets the recipe's communication hook before the first
    forward;
  - optimizers: the weight store goes around an optimizer at its first step, or at
    :meth:`setup_optimizers`; call that after ``fabric.setup`` and before a ``fabric.load`` that restores the
    optimizers' state (loaded into low-precision parameters, torch would cast FP32 state to their dtype:
    found at the first step, it is a warning, and for 8-bit states an error);

* at the first forward autocast follows the training device (a warning when the plugin's ``device`` said
  another) and a float16 recipe on a CPU without native float16 gets the core's notice, once;
* ``teardown`` removes hooks, FP8 matmuls and the DDP watch; masters and scaler state are kept.

It uses the plugin's ``recipe``, ``weight_store``, ``fp8``, ``comm_counter``, ``keep_in_fp32`` and the
set-up fields ``__init__`` makes (``_root``, ``_optimizers``, ``_policy_handle``...).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from mp_callbacks.advice import cpu_flags, cpu_float16_notice

from .distributed import DDPWatch, inspect_sharded, register_comm_hook
from .loss_scale import unwrap_optimizer
from .policy import apply_module_policy, cast_module_storage
from .support import check_optimizer
from .weights import EightBitAdamW
from .weights.low_bit import RECORD_KEY, plain_state_checkpoints

__all__ = ["RecipeSetup"]


class RecipeSetup:
    """Set-up and teardown of :class:`lightning_ext.fabric.MixedPrecision` (a base class of it, not used alone)."""

    recipe: Any
    weight_store: Any
    fp8: Any
    comm_counter: Any
    pending_fp32_paths: list[str]

    def convert_module(self, module: nn.Module) -> nn.Module:
        """Apply the recipe to the model now (see the module's rules for a model the strategy shards later)."""
        self._root = module
        self._apply_recipe(module, sharded=False)
        if self._ddp_watch is not None:
            self._ddp_watch.remove()
        self._ddp_watch = DDPWatch(module)
        return module

    def prepare_sharding(self, module: nn.Module) -> None:
        """Before ``fully_shard`` shards ``module`` under Fabric: undo the recipe ``convert_module`` put on it (the
        parameters get their FP32 values back: the FP32 shards are the masters); the recipe for a sharded
        model goes on at the first forward.  :func:`~lightning_ext.distributed.fully_shard_model` calls it when given
        the plugin."""
        if self._root is not module or self._await_sharding:
            return
        self._remove_hooks()
        if self.weight_store is not None:
            self.weight_store.restore_originals(module)
        self._await_sharding = True

    def _apply_recipe(self, module: nn.Module, sharded: bool) -> None:
        """Parameter storage (``*-master``, ``bf16-kahan``/``-sr``; sharded: the FP32 shards stay the masters),
        FP32-op hooks, FP8 matmuls."""
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

    def _start(self) -> None:
        """At the first forward: autocast on the training device and the float16 notice (once); under Fabric, after
        each ``convert_module``, the DDP hook and the recipe of a model sharded since."""
        root = self._root
        if not self._started:
            self._started = True
            self._follow_the_device(root)
        watch, self._ddp_watch = self._ddp_watch, None
        if watch is not None:
            watch.remove()
            if self._await_sharding:
                self._await_sharding = False
                self._apply_recipe(root, sharded=True)
            register_comm_hook(watch.wrapper if watch.wrapper is not None else root, self.recipe.comm_dtype,
                               self.comm_counter)

    def _follow_the_device(self, root: nn.Module | None) -> None:
        """Autocast follows the device the model trains on; a float16 recipe on a CPU without native float16
        gets the core's notice."""
        if root is not None and self.recipe.low_precision:
            param = next(root.parameters(), None)
            if param is not None and param.device.type != self._device_type:
                warnings.warn(
                    f"MixedPrecision(device={self.device!r}) but the model trains on {param.device}: autocast follows "
                    f"the training device, {param.device.type!r}. Pass device={param.device.type!r} to silence this "
                    "warning.", stacklevel=5)
                self._device_type = param.device.type
                if self._policy_handle is not None:
                    self._policy_handle.device_type = self._device_type
        notice = cpu_float16_notice(self.recipe.name, self.recipe.policy.compute, self._device_type, cpu_flags())
        if notice is not None:
            warnings.warn(f"lightning_ext.MixedPrecision: {notice}", UserWarning, stacklevel=5)

    def setup_optimizers(self, *optimizers: Any) -> None:
        """Put the recipe's weight store (FP32 masters, update rounding, 8-bit states) around ``optimizers`` now.

        Fabric shows a precision plugin no optimizer before the optimizer's first step, which installs the store
        then.  Call this after ``fabric.setup`` and before a ``fabric.load`` that restores the optimizers' state.
        The Trainer plugin installs the store in ``connect``.
        """
        raws = [unwrap_optimizer(o) for o in optimizers]
        for raw in raws:
            check_optimizer(raw, self.recipe.name)
        new = [raw for raw in raws if not any(raw is o for o in self._optimizers)]
        if new:
            self._install(self._root, [*self._optimizers, *new])

    def _install(self, root: nn.Module | None, optimizers: list[Optimizer]) -> None:
        """Put the weight store around ``optimizers`` (all of them: rounding re-installs whole), then apply
        FP32 moves that waited for the masters.  Under FSDP2 masters are not installed (the shards are).
        Under ``state_dtype="8bit"`` each optimizer gets its 8-bit update
        (:class:`~lightning_ext.weights.EightBitAdamW`); torchao optimizers save quantized states as plain data."""
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
        """The raw optimizer, with the weight store around it: installed now when the plugin has not seen it (its
        first step under Fabric); state loaded into it before then was cast by torch (see the module's rules)."""
        raw = unwrap_optimizer(optimizer)
        if any(raw is o for o in self._optimizers):
            return raw
        if self.weight_store is not None and self._root is not None and self.sharded is None:
            self._check_loaded_state(raw)
        self.setup_optimizers(raw)
        return raw

    def _check_loaded_state(self, raw: Any) -> None:
        """A warning (8-bit records: an error) when ``raw`` holds state torch cast to its low-precision
        parameters' dtype: state loaded before the plugin saw the optimizer."""
        fix = ("call the plugin's setup_optimizers(optimizer) after fabric.setup and before fabric.load "
               "(mp = fabric.strategy.precision)")
        cast = False
        for p in (p for g in raw.param_groups for p in g["params"]):
            for value in raw.state.get(p, {}).values():
                if isinstance(value, dict) and RECORD_KEY in value:
                    raise RuntimeError(f"lightning_ext MixedPrecision({self.recipe.name!r}): the optimizer's 8-bit "
                                       f"states were loaded before the plugin saw the optimizer; {fix}")
                low = p.is_floating_point() and p.dtype != torch.float32
                if low and isinstance(value, torch.Tensor) and value.dim() and value.dtype == p.dtype:
                    cast = True
        if cast:
            warnings.warn(f"lightning_ext MixedPrecision({self.recipe.name!r}): the optimizer's state was loaded "
                          "before the plugin saw the optimizer, so torch cast it to the parameters' low-precision "
                          f"dtype and the resume is not exact; {fix}", stacklevel=5)

    # --------------------------------------------------------------- teardown
    def _remove_hooks(self) -> None:
        if self._policy_handle is not None:
            self._policy_handle.remove()
            self._policy_handle = None
        self._hooked_module = None
        if self.fp8 is not None:
            self.fp8.remove()

    def teardown(self) -> None:
        """Remove the op-policy hooks, FP8 matmuls and the DDP watch; keep masters and scaler state."""
        self._remove_hooks()
        self._root = None
        if self.weight_store is not None:
            self.weight_store.clear_cache()
        if self._ddp_watch is not None:
            self._ddp_watch.remove()
            self._ddp_watch = None
