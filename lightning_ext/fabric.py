"""``lightning_ext.fabric.MixedPrecision``: the core's recipes as a Lightning Fabric precision plugin.

``Fabric(plugins=[MixedPrecision("bf16-master")])`` trains with every recipe.  This class holds the
adapter's logic; the Trainer plugin (:class:`lightning_ext.trainer.MixedPrecision`) is a thin subclass
of it and of Lightning's Trainer ``Precision``, the pattern of Lightning's ``TransformerEnginePrecision``.
It hands off as the Trainer plugin does: the loss scaler to :class:`~lightning_ext.loss_scale.TorchLossScaler`,
the weights to one weight store (:func:`~lightning_ext.weights.weight_store`: FP32 masters or update
rounding), FP32 regions and storage to :mod:`~lightning_ext.policy`, FP8 to :class:`~lightning_ext.fp8.TorchFP8`;
set-up and teardown (the recipe on the model, the weight store around the optimizers) are
:class:`~lightning_ext.setup.RecipeSetup`'s.

One Fabric step::

    loss = loss_fn(model(x), y)  # under forward_context; float inputs cast to the compute dtype, outputs to FP32
    fabric.backward(loss)        # backward of loss * scale (in backward: Fabric ignores pre_backward's result)
    fabric.clip_gradients(model, optimizer, max_norm=1.0)  # optional: unscaled FP32 (master) gradients
    optimizer.step()             # unscale and check once, step or skip, update the scale
    optimizer.zero_grad()

Rules of the Fabric side:

* setup: ``fabric.setup(model, optimizer)`` applies the recipe to the model; the weight store goes around
  each optimizer at its first step, or earlier with :meth:`setup_optimizers` (call it before a ``fabric.load``
  that restores optimizer state); under ``ModelParallelStrategy`` pass the plugin to
  :func:`~lightning_ext.distributed.fully_shard_model` in the ``parallelize_fn`` (:mod:`lightning_ext.setup`);
* a skipped step changes no parameter, master, optimizer state or step count; clipping on such a step
  sees no parameters (no ``error_if_nonfinite`` raise);
* checkpoints: pass the plugin in the state, ``{"model": model, "optimizer": optimizer, "mp":
  fabric.strategy.precision}``, for ``fabric.save`` and ``fabric.load``; a sharded (directory) checkpoint
  of ``ModelParallelStrategy`` puts the saved dict in ``state["mp"]`` instead: ``mp.load_state_dict`` it;
* ``*-master``: ``optimizer.zero_grad()`` clears the masters' gradients; a backward never stepped leaves the
  model's low-precision ones (``model.zero_grad()``);
* LR schedulers: Fabric never shows them to the plugin; step one when ``not mp.last_step_skipped(optimizer)``;
* the divergence rule raises from ``optimizer.step()`` (:mod:`lightning_ext.loss_scale.divergence`); the monitor is a
  Fabric callback (:class:`lightning_ext.diagnostics.monitor.FabricMonitor`).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from lightning.fabric.plugins.precision import Precision
from torch import Tensor, nn
from torch.optim import LBFGS, Optimizer

from mp_callbacks.loss_scale import ScalerConfig
from mp_callbacks.policy import PrecisionPolicy
from mp_callbacks.recipes import Recipe, get_recipe
from mp_callbacks.settings import StateDictError

from .checkpoint import loaded_from, plugin_record
from .checkpoint.record import check_scaler_record, load_parts, name_the_file, resume_plan, saved_fp32_rules
from .distributed import CommCounter, DDPWatch, ShardedLayout, fsdp_policy
from .fp8 import TorchFP8
from .loss_scale import ExternalScaler, ForwardState, unwrap_optimizer
from .loss_scale.external import loss_scaler_for, optimizer_unscales_in_step
from .policy import ModulePolicyHandle, torch_dtype
from .setup import RecipeSetup
from .support import cast_floats, recipe_name
from .weights import EightBitAdamW, MasterWeights, UpdateRounding, weight_store

__all__ = ["MixedPrecision"]


class MixedPrecision(RecipeSetup, Precision):
    """Mixed-precision training for Lightning Fabric (and, subclassed, the Trainer) driven by the core.

    Args:
      precision: a recipe (``"32-true"``, ``"16-mixed"``, ``"bf16-mixed"``, ``"16-master"``,
        ``"bf16-master"``, ``"bf16-kahan"``, ``"bf16-sr"``, ``"fp8-mixed"``) or an alias (``"mixed_float16"``...).
      device: the device type for ``torch.autocast`` (``"cpu"``, ``"cuda"``...; the training device wins).
      scaler: a ``torch.amp.GradScaler`` (its settings are taken), a
        :class:`~mp_callbacks.loss_scale.ScalerConfig`, a preset name (``"torch"``,
        ``"megatron"``...), a dict of fields, or None for the recipe's default
        (dynamic ``torch`` preset for fp16, off for bf16/fp32).  Another object with
        ``GradScaler``'s API is used as it is, as Lightning uses it (``16-mixed`` only, no
        monitors: :mod:`lightning_ext.loss_scale.external`).
      policy: the operator policy (a :class:`~mp_callbacks.policy.PrecisionPolicy`,
        a policy string or dict), or None for the recipe's.
      count_overflows: with ``scaler={"enabled": False, "skip_nonfinite": False}``
        only (otherwise every step checks and skips non-finite gradients): whether
        steps still count them (None: while a monitor is attached).
      free_weights_during_step: ``*-master`` only: release the low-precision
        weights while ``optimizer.step()`` updates the masters (rebuilt right
        after).  Set False if an optimizer step hook of yours reads the weights.
      allow_recipe_change: resume checkpoints saved under another recipe
        (:func:`mp_callbacks.recipes.plan_resume`); refused by default.
      divergence: when to stop a run that cannot recover
        (:class:`~mp_callbacks.diagnostics.DivergenceRule`; None: the default rule, False: never).
      state_dtype: ``"bfloat16"`` optimizer states (``bf16-kahan``/``bf16-sr``), ``"8bit"`` (master and rounding
        recipes: the AdamW becomes torchao's ``AdamW8bit``, :mod:`lightning_ext.weights.low_bit`); None: FP32.
      seed: ``bf16-sr``'s stochastic-rounding seed (:mod:`mp_callbacks.weights`).
      comm_dtype: the dtype gradients are reduced across ranks in (``"float32"`` default,
        ``"bfloat16"``, ``"float16"``): a DDP communication hook (:mod:`lightning_ext.distributed`),
        FSDP2's ``reduce_dtype`` (:meth:`fsdp_policy`).
      fp8: ``fp8-mixed`` only: the FP8 scaling settings (a preset name, ``"transformer-engine"``
        default, ``"keras"``, ``"torchao"``, or a dict such as ``{"mode": "current"}``:
        :class:`~mp_callbacks.fp8.FP8Recipe`).
      master_remainders: ``bf16-master``/``fp8-mixed``: hold each FP32 master as its bf16 weight plus a
        16-bit remainder between steps (:mod:`mp_callbacks.weights.remainders`: the same exact masters, 2 B/param
        less; the forward weight rounds ties away from zero); None: the recipe's default.
      restore_forward_state: on a skipped step, put back the buffers the forward wrote (BatchNorm
        running statistics...: :mod:`lightning_ext.loss_scale.forward_state`); False saves a copy per step.

    Raises:
      RecipeError: an unknown recipe name (the message lists the valid ones).
    """

    def __init__(
        self, precision: str = "bf16-mixed", device: str | torch.device = "cpu",
        scaler: torch.amp.GradScaler | ScalerConfig | str | Mapping[str, Any] | None = None,
        policy: PrecisionPolicy | str | Mapping[str, Any] | None = None, count_overflows: bool | None = None,
        free_weights_during_step: bool = True, allow_recipe_change: bool = False, divergence: Any = None,
        state_dtype: str | None = None, seed: int = 0, comm_dtype: str | None = None, fp8: Any = None,
        restore_forward_state: bool = True, master_remainders: bool | None = None,
    ) -> None:
        self.recipe: Recipe = get_recipe(recipe_name(precision), policy=policy, state_dtype=state_dtype,
                                         comm_dtype=comm_dtype).with_fp8(fp8).with_master_remainders(master_remainders)
        self.precision = self.recipe.name  # type: ignore[assignment]
        known = isinstance(device, (str, torch.device))
        self.device = str(device) if known else device  # another object (a test double) is kept as given
        self._device_type = torch.device(device).type if known else "cpu"
        self.allow_recipe_change = bool(allow_recipe_change)
        self.weight_store: MasterWeights | UpdateRounding | None = weight_store(self.recipe, seed,
                                                                                 free_weights_during_step)
        self.fp8: TorchFP8 | None = TorchFP8.for_recipe(self.recipe)  # fp8-mixed: FP8 matmuls, their scales
        self._scaler_args = (count_overflows, divergence)
        self.scaler = scaler  # sets loss_scaler (and the recipe's scaler settings)
        self._policy_handle: ModulePolicyHandle | None = None
        self._hooked_module: nn.Module | None = None
        self._root: nn.Module | None = None  # the model the recipe was applied to
        self._optimizers: list[Optimizer] = []  # what the weight store is installed around
        self._low_bit: dict[int, EightBitAdamW] = {}  # id(optimizer) -> its 8-bit update (state_dtype="8bit")
        self._unscaled: dict[int, Tensor | None] = {}  # id(optimizer) -> found_inf of the coming step
        self._ddp_watch: DDPWatch | None = None  # Fabric: the DDP wrapper of the model, seen at set-up
        self._await_sharding = False  # Fabric: the model is sharded after convert_module (prepare_sharding)
        self._started = False  # the first forward ran (lightning_ext.setup)
        self.forward_state = ForwardState() if restore_forward_state else None
        self.pending_fp32_paths: list[str] = []
        self.sharded: ShardedLayout | None = None  # under ModelParallelStrategy (FSDP2): lightning_ext.distributed.fsdp
        self.comm_counter: CommCounter | None = None  # counts DDP all-reduce / FSDP2 bytes (lightning_ext.distributed)

    # ------------------------------------------------------------ reading
    @property
    def scaler(self) -> Any:
        """The loss scaler when the recipe scales the loss (``trainer.scaler``), else None (as native);
        an external scaler is returned as given."""
        if isinstance(self.loss_scaler, ExternalScaler):
            return self.loss_scaler.scaler
        return self.loss_scaler if self.loss_scaler.config.enabled else None

    @scaler.setter
    def scaler(self, value: Any) -> None:
        """Before training: the loss scaler for ``value`` (the ``scaler`` argument's meanings:
        :func:`~lightning_ext.loss_scale.external.loss_scaler_for`)."""
        self.recipe, self.loss_scaler = loss_scaler_for(value, self.recipe, *self._scaler_args)

    @property
    def masters(self) -> MasterWeights | None:
        """The weight store when it keeps FP32 masters (``*-master``, ``fp8-mixed``), else None."""
        return self.weight_store if isinstance(self.weight_store, MasterWeights) else None

    @property
    def rounding(self) -> UpdateRounding | None:
        """The weight store when it rounds updates (``bf16-kahan``, ``bf16-sr``), else None."""
        return self.weight_store if isinstance(self.weight_store, UpdateRounding) else None

    @property
    def policy(self) -> PrecisionPolicy:
        """The operator precision policy in use."""
        return self.recipe.policy

    @property
    def master_weights(self) -> bool:
        """True for ``*-master`` recipes (FP32 master copies inside the optimizer)."""
        return self.masters is not None

    @property
    def compute_dtype(self) -> torch.dtype:
        """The low-precision compute dtype (float32 for ``32-true``)."""
        return torch_dtype(self.recipe.policy.compute)

    @property
    def can_skip(self) -> bool:
        """True when a step can be skipped (:attr:`~mp_callbacks.loss_scale.ScalerConfig.can_skip`)."""
        return self.loss_scaler.config.can_skip

    @property
    def free_weights_during_step(self) -> bool:
        """Whether ``*-master`` releases the low-precision weights during the optimizer step."""
        return self.weight_store.free_weights_during_step if self.weight_store is not None else False

    @property
    def count_overflows(self) -> bool | None:
        """The ``count_overflows`` setting (see the class docstring)."""
        return self.loss_scaler.count_overflows

    @property
    def checks_overflow(self) -> bool:
        """True when steps look for inf/NaN gradients (:func:`mp_callbacks.loss_scale.checks_overflow`)."""
        return self.loss_scaler.checks_overflow

    @property
    def root_module(self) -> nn.Module | None:
        """The model the recipe was applied to (None outside a fit)."""
        return self._hooked_module if self._hooked_module is not None else self._root

    def __repr__(self) -> str:
        return f"{type(self).__name__}(precision={self.precision!r}, device={self.device!r})"

    def fsdp_policy(self, module: nn.Module | None = None, path: str = "") -> Any:
        """torch FSDP2's ``MixedPrecisionPolicy`` for this recipe (for ``module``: FP32 for one the
        policy keeps in FP32), for ``fully_shard(..., mp_policy=...)``."""
        return fsdp_policy(self.recipe, module, path)

    # ------------------------------------------------------------- forward
    def autocast_context_manager(self) -> contextlib.AbstractContextManager:
        """``torch.autocast`` in the compute dtype (a null context for ``32-true``)."""
        if not self.recipe.low_precision:
            return contextlib.nullcontext()
        return torch.autocast(self._device_type, dtype=self.compute_dtype)

    def forward_context(self) -> contextlib.AbstractContextManager:
        """Forward passes run under the recipe's autocast (a ``torch.autocast`` object, as native); a step's
        first training forward keeps the buffers it may write (:mod:`lightning_ext.loss_scale.forward_state`)."""
        if not self._started or self._ddp_watch is not None:
            self._start()
        if self.forward_state is not None:
            self.forward_state.begin(self.root_module)
        return self.autocast_context_manager()

    def convert_input(self, data: Any) -> Any:
        """Float tensors in the model's inputs become the compute dtype (low-precision recipes)."""
        return cast_floats(data, self.compute_dtype) if self.recipe.low_precision else data

    def convert_output(self, data: Any) -> Any:
        """Float tensors in the model's outputs become the default dtype (FP32; low-precision recipes)."""
        return cast_floats(data, torch.get_default_dtype()) if self.recipe.low_precision else data

    # --------------------------------------------------------------- steps
    def backward(self, tensor: Tensor, model: nn.Module | None, *args: Any, **kwargs: Any) -> None:
        """The backward of ``loss * scale`` (when scaling is enabled)."""
        if isinstance(tensor, Tensor):
            self.loss_scaler.to(tensor.device)
        monitor = getattr(self.loss_scaler, "monitor", None)
        if monitor is not None and hasattr(monitor, "on_loss"):
            monitor.on_loss(tensor)
        self.loss_scaler.scale(tensor).backward(*args, **kwargs)

    def unscale_gradients(self, optimizer: Any) -> Tensor | None:
        """Unscale (under ``*-master``: onto the masters) ``optimizer``'s gradients; returns ``found_inf``.
        A second call before the step returns the first result."""
        raw = unwrap_optimizer(optimizer)
        if isinstance(self.loss_scaler, ExternalScaler) and optimizer_unscales_in_step(raw):
            raise NotImplementedError("Gradient clipping is not implemented for optimizers handling the unscaling.")
        return self._unscale(self._ensure_installed(raw))

    def main_params(self, optimizer: Any) -> Iterator[nn.Parameter]:
        """What clipping sees: the unscaled parameters the optimizer updates (FP32 masters under ``*-master``);
        none on a step that will be skipped (the step's one host read, made early)."""
        raw = self._ensure_installed(optimizer)
        self._unscale(raw)
        if not isinstance(self.loss_scaler, ExternalScaler) and self.loss_scaler.skips(raw):
            return iter(())
        return (p for group in raw.param_groups for p in group["params"])

    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        """Unscale and check (once), then step or skip the optimizer and update the scale."""
        raw = self._ensure_installed(optimizer)
        if isinstance(raw, LBFGS) and self.recipe.name == "32-true":
            return raw.step(**kwargs)
        self._unscale(raw)
        monitor = getattr(self.loss_scaler, "monitor", None)
        if monitor is not None and hasattr(monitor, "before_optimizer_step"):
            monitor.before_optimizer_step(self, raw)  # unscaled FP32 gradients, before the decision
        return self._step_and_update(raw, **kwargs)

    # ------------------------------------------------- the step, in order
    def _unscale(self, raw: Any) -> Tensor | None:
        """Once per step: the gradients onto the FP32 masters (the weight store), then checked and unscaled
        (the loss scaler); a non-finite FP8 amax joins ``found_inf`` (FP8)."""
        key = id(raw)
        if key in self._unscaled:
            return self._unscaled[key]
        if self.weight_store is not None:
            self.weight_store.collect_grads(raw)
        found_inf = self.loss_scaler.unscale_once(raw)
        if self.fp8 is not None:
            self.fp8.before_step(found_inf)
        self._unscaled[key] = found_inf
        return found_inf

    def _step_and_update(self, raw: Any, **kwargs: Any) -> Any:
        """The step's decision, in one place, and what follows it.

        The loss scaler decides (:meth:`TorchLossScaler.skips`: one host read of ``found_inf`` where the step
        can be skipped; an external scaler decides in its own ``step``); an applied step is the weight store's
        (masters or update rounding, with the 8-bit update where ``state_dtype="8bit"``) or the user's
        ``optimizer.step()`` as torch wrote it; then the scale's transition (the divergence rule sees the
        decision), the FP8 scales on applied steps, the forward's buffers back on skipped ones.
        """
        self._unscaled.pop(id(raw), None)
        scaler = self.loss_scaler
        skipped = False
        if isinstance(scaler, ExternalScaler):
            output = scaler.step(raw, **kwargs)
        elif scaler.skips(raw):
            output, skipped = None, True
        elif self.weight_store is not None:
            output = self.weight_store.step(raw, self._low_bit.get(id(raw)), **kwargs)
        else:
            output = raw.step(**kwargs)
        scaler.update()
        if self.fp8 is not None:  # no host read: the FP8 states select on the device
            self.fp8.after_step(not skipped)
        if self.forward_state is not None:
            self.forward_state.end(skipped)
        return output

    def _abandon_step(self, raw: Any) -> None:
        """A closure that ran no backward (``training_step`` returned None): no decision, no transition."""
        self._unscaled.pop(id(raw), None)
        self.loss_scaler.forget_step(raw)
        if self.fp8 is not None:
            self.fp8.discard_step()
        if self.forward_state is not None:
            self.forward_state.end(False)

    def last_step_skipped(self, optimizer: Any | None = None) -> bool:
        """True when the latest step (of ``optimizer``, or of any) applied no update: step your LR
        schedulers only when this is False (Fabric, manual optimization)."""
        return self.loss_scaler.last_step_skipped(optimizer)

    def latest_stats(self) -> dict[str, Tensor]:
        """Device tensors of the latest step (no sync): :meth:`TorchLossScaler.latest`."""
        return self.loss_scaler.latest()

    # ------------------------------------------------------ runtime FP32 moves
    def keep_in_fp32(self, path: str, module: nn.Module | None = None) -> PrecisionPolicy:
        """Move the module at dotted ``path`` to FP32 now; training continues.  Returns the new policy.

        The policy gains ``with_fp32_modules(path)`` (kept by ``convert_module``
        and checkpoints); the module becomes an FP32 region; under ``*-master``
        its low-precision parameters are re-stored in FP32 from their masters.
        """
        if not isinstance(path, str) or not path:
            raise ValueError(f"keep_in_fp32 needs a non-empty dotted module path, not {path!r}")
        self.recipe = self.recipe.with_policy(self.recipe.policy.with_fp32_modules(path))
        root = self.root_module
        if module is None:
            if root is None:
                return self.policy  # not fitting yet: convert_module applies the rule
            module = root.get_submodule(path)
        if self.recipe.low_precision and self._policy_handle is not None:
            self._policy_handle.add_region(module, path)
        if self.weight_store is not None:  # low-precision parameters re-stored in FP32 (from masters / w + c)
            self.weight_store.store_fp32(module)
        if self.fp8 is not None:  # an FP32 region has no FP8 matmuls
            self.fp8.remove(path)
        return self.policy

    # ------------------------------------------------------------ checkpoints
    def master_state_dict(self) -> dict[str, Tensor]:
        """``{parameter name: FP32 master}`` (empty unless ``*-master``)."""
        return self.masters.state_dict() if self.masters is not None else {}

    def state_dict(self) -> dict[str, Any]:
        """Plain data: recipe, scaler record, FP32 masters, policy, rounding, FP8 (:mod:`lightning_ext.checkpoint`)."""
        return plugin_record(self.recipe, self.loss_scaler, self.weight_store, self.fp8)

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore a :meth:`state_dict`; another schema, recipe or scaler config is an error naming both (and
        the file, when a ``fabric.load`` reads one).  Under another recipe (``allow_recipe_change``) the masters
        where both keep them; the scaler restarts."""
        try:
            self._load_state_dict(state_dict)
        except StateDictError as exc:
            name_the_file(exc, self._ckpt_path(state_dict))
            raise

    def _ckpt_path(self, state_dict: Any = None) -> Any:
        """The checkpoint file ``state_dict`` came from, when known (Fabric: read by ``CheckedCheckpointIO``)."""
        return loaded_from(state_dict)

    def _load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        plan = resume_plan(state_dict, self.recipe, self.allow_recipe_change)
        if plan.load_scaler:  # same recipe: a scaler mismatch is an error before anything changes
            check_scaler_record(self.loss_scaler, state_dict["scaler"])
            self._restore_policy(state_dict.get("policy"))
            self.loss_scaler.load_state_dict(state_dict["scaler"])
        load_parts(state_dict, plan, self.weight_store, self.fp8)
        if plan.changes_recipe:
            warnings.warn(f"lightning_ext.MixedPrecision: {plan.warning()}", stacklevel=2)

    def _restore_policy(self, saved: Any) -> None:
        """Re-apply the FP32 module rules a checkpointed policy added (:func:`~mp_callbacks.policy.added_fp32_rules`):
        a module path moves to FP32 now (once the masters exist), a class name or glob becomes a policy rule."""
        for pattern, module in saved_fp32_rules(saved, self.policy, self.root_module):
            if module is None or (self.masters is not None and not self.masters):
                self.recipe = self.recipe.with_policy(self.recipe.policy.with_fp32_modules(pattern))
                if module is not None:
                    self.pending_fp32_paths.append(pattern)
            else:
                self.keep_in_fp32(pattern, module)
