"""``lightning_ext.MixedPrecision``: the core's recipes as a Lightning precision plugin.

A drop-in for Lightning's ``MixedPrecision`` that, like Lightning's ``amp.py``,
holds the Lightning hooks and hands off: the loss scaler to
:class:`~lightning_ext.scaler.TorchLossScaler` (``plugin.scaler`` /
``trainer.scaler`` when the recipe scales the loss, else None; ``loss_scaler``
always, it counts overflows for monitors), FP32 masters to :class:`~lightning_ext.masters.MasterWeights`,
update rounding (``bf16-kahan``, ``bf16-sr``) to :class:`~lightning_ext.rounding.UpdateRounding`,
the LR-scheduler hold to :class:`~lightning_ext.scheduler_hold.SchedulerHold`, FP32 regions and storage
to :mod:`~lightning_ext.policy`, what it trains with to :mod:`~lightning_ext.support`, FP8
matmuls and their per-tensor scaling (``fp8-mixed``) to :class:`~lightning_ext.fp8.TorchFP8` (``plugin.fp8``).

One optimizer step: the closure runs the backward of ``loss * scale``; the
scaler unscales (grads move to the masters first) and checks; hooks and
clipping see unscaled FP32 gradients; the scaler steps the optimizer unless the
gradients are not finite (a skipped step changes no parameter, master,
optimizer state, step count or step-interval schedule), then updates the scale.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Generator, Mapping
from typing import Any

import torch
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities import GradClipAlgorithmType
from torch import Tensor, nn
from torch.optim import LBFGS, Optimizer

from mp_callbacks.loss_scale.config import ScalerConfig
from mp_callbacks.policy import PrecisionPolicy
from mp_callbacks.recipes import Recipe, get_recipe

from .checkpoint import PLUGIN_SCHEMA, PLUGIN_SCHEMA_VERSION, load_plugin_record, masters_as_weights, plugin_record
from .distributed import CommCounter, register_comm_hook
from .external_scaler import ExternalScaler, is_external_scaler, optimizer_unscales_in_step
from .fp8 import TorchFP8
from .fsdp import ShardedLayout, fsdp_policy, inspect_sharded
from .masters import MasterWeights
from .policy import ModulePolicyHandle, apply_module_policy, cast_module_storage, torch_dtype
from .rounding import UpdateRounding
from .scaler import TorchLossScaler, scaler_config_from, unwrap_optimizer
from .scheduler_hold import SchedulerHold
from .support import check_optimizer, check_strategy, is_sharded, recipe_name

__all__ = ["MixedPrecision", "PLUGIN_SCHEMA", "PLUGIN_SCHEMA_VERSION"]

class MixedPrecision(Precision):
    """Mixed-precision training for Lightning driven by the :mod:`mp_callbacks` core.

    Args:
      precision: a recipe (``"32-true"``, ``"16-mixed"``, ``"bf16-mixed"``, ``"16-master"``,
        ``"bf16-master"``, ``"bf16-kahan"``, ``"bf16-sr"``) or an alias (``"mixed_float16"``...).
      device: the device type for ``torch.autocast`` (``"cpu"``, ``"cuda"``...).
      scaler: a ``torch.amp.GradScaler`` (its settings are taken), a
        :class:`~mp_callbacks.loss_scale.config.ScalerConfig`, a preset name (``"torch"``,
        ``"megatron"``...), a dict of fields, or None for the recipe's default
        (dynamic ``torch`` preset for fp16, off for bf16/fp32).  Another object with
        ``GradScaler``'s API is used as it is, as Lightning uses it (``16-mixed`` only, no
        monitors: :mod:`lightning_ext.external_scaler`).
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
        (:class:`~mp_callbacks.diagnostics.divergence.DivergenceRule`; None: the default rule, False: never).
      state_dtype: ``bf16-kahan``/``bf16-sr`` only: ``"bfloat16"`` optimizer states (None: FP32).
      seed: ``bf16-sr``'s stochastic-rounding seed (:mod:`mp_callbacks.rounding`).
      fp8: ``fp8-mixed`` only: the FP8 scaling settings (a preset name, ``"transformer-engine"``
        default, ``"keras"``, ``"torchao"``, or a dict such as ``{"mode": "current"}``,
        ``{"history_len": 16, "margin": 1}``: :class:`~mp_callbacks.fp8.recipe.FP8Recipe`).
      comm_dtype: the dtype gradients are reduced across ranks in (``"float32"`` default,
        ``"bfloat16"``, ``"float16"``): a DDP communication hook (:mod:`lightning_ext.distributed`),
        FSDP2's ``reduce_dtype`` (:meth:`fsdp_policy`).

    Raises:
      RecipeError: an unknown recipe name (the message lists the valid ones).
    """

    def __init__(
        self,
        precision: str = "bf16-mixed",
        device: str | torch.device = "cpu",
        scaler: torch.amp.GradScaler | ScalerConfig | str | Mapping[str, Any] | None = None,
        policy: PrecisionPolicy | str | Mapping[str, Any] | None = None,
        count_overflows: bool | None = None,
        free_weights_during_step: bool = True,
        allow_recipe_change: bool = False,
        divergence: Any = None,
        state_dtype: str | None = None, seed: int = 0, comm_dtype: str | None = None,
        fp8: Any = None,
    ) -> None:
        external = scaler if is_external_scaler(scaler) else None
        self.recipe: Recipe = get_recipe(recipe_name(precision), policy=policy,
                                         scaler=None if external is not None else scaler_config_from(scaler),
                                         state_dtype=state_dtype, comm_dtype=comm_dtype)
        self.recipe = self.recipe.with_fp8(fp8)
        self.precision = self.recipe.name  # type: ignore[assignment]
        self.device = str(device)
        self.allow_recipe_change = bool(allow_recipe_change)
        self._device_type = torch.device(device).type
        self.masters: MasterWeights | None = (
            MasterWeights(free_weights_during_step) if self.recipe.master.master_weights else None)
        self.rounding: UpdateRounding | None = UpdateRounding.for_recipe(self.recipe, seed)
        self.fp8: TorchFP8 | None = TorchFP8.for_recipe(self.recipe)  # fp8-mixed: FP8 matmuls, their scales
        self.loss_scaler: Any = TorchLossScaler(self.recipe.scaler, self.masters, count_overflows, divergence,
                                                self.rounding)
        if external is not None:
            if self.recipe.name != "16-mixed":
                raise ValueError(f"An external scaler ({type(external).__name__}) works with precision='16-mixed' "
                                 f"only, not {self.recipe.name!r}: pass its settings as a torch GradScaler instead.")
            self.loss_scaler = ExternalScaler(external, self.recipe.scaler)
        self._hold = SchedulerHold(self.loss_scaler.last_step_skipped)
        self._policy_handle: ModulePolicyHandle | None = None
        self._hooked_module: nn.Module | None = None
        self._lightning_module: Any = None
        self.pending_fp32_paths: list[str] = []
        self.sharded: ShardedLayout | None = None  # under ModelParallelStrategy (FSDP2): lightning_ext.fsdp
        self.comm_counter: CommCounter | None = None  # set one to count DDP all-reduce / FSDP2 collective bytes (lightning_ext.distributed)

    @property
    def scaler(self) -> Any:
        """The loss scaler when the recipe scales the loss (``trainer.scaler``), else None (as native);
        an external scaler is returned as given."""
        if isinstance(self.loss_scaler, ExternalScaler):
            return self.loss_scaler.scaler
        return self.loss_scaler if self.loss_scaler.config.enabled else None

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
        """True when a step can be skipped (:attr:`~mp_callbacks.loss_scale.config.ScalerConfig.can_skip`): one host read."""
        return self.loss_scaler.config.can_skip

    @property
    def free_weights_during_step(self) -> bool:
        """Whether ``*-master`` releases the low-precision weights during the optimizer step."""
        return self.masters.free_weights_during_step if self.masters is not None else False

    @property
    def count_overflows(self) -> bool | None:
        """The ``count_overflows`` setting (see the class docstring)."""
        return self.loss_scaler.count_overflows

    @property
    def checks_overflow(self) -> bool:
        """True when steps look for inf/NaN gradients (:func:`mp_callbacks.loss_scale.scaler.checks_overflow`)."""
        return self.loss_scaler.checks_overflow

    def __repr__(self) -> str:
        return f"{type(self).__name__}(precision={self.precision!r}, device={self.device!r})"

    def fsdp_policy(self, module: nn.Module | None = None, path: str = "") -> Any:
        """torch FSDP2's ``MixedPrecisionPolicy`` for this recipe (for ``module``: FP32 for one the
        policy keeps in FP32), for ``fully_shard(..., mp_policy=...)`` in ``configure_model``."""
        return fsdp_policy(self.recipe, module, path)

    # ---------------------------------------------------------- module / setup
    def convert_module(self, module: nn.Module) -> nn.Module:
        """Apply the recipe to the model: parameter storage (``*-master``, ``bf16-kahan``/``-sr``), FP32-op hooks."""
        trainer = getattr(module, "_trainer", None)
        strategy = getattr(trainer, "strategy", None) if trainer is not None else None
        if strategy is not None:
            check_strategy(strategy)
            self.sharded = inspect_sharded(module, self.recipe) if is_sharded(strategy) else None
            root = getattr(strategy, "root_device", None)
            if isinstance(root, torch.device) and root.type != self._device_type and self.recipe.low_precision:
                warnings.warn(
                    f"MixedPrecision(device={self.device!r}) but the model trains on {root}: autocast follows the "
                    f"training device, {root.type!r}. Pass device={root.type!r} to silence this warning.",
                    stacklevel=2)
                self._device_type = root.type
        self._lightning_module = module
        store = self.masters if self.masters is not None else self.rounding
        if store is not None and self.sharded is None:  # sharded: the FP32 shards are the masters
            store.record_originals(module, cast_module_storage(module, self.policy, self.compute_dtype))
        if self.recipe.low_precision and self._hooked_module is not module:
            if self._policy_handle is not None:
                self._policy_handle.remove()
            self._policy_handle = apply_module_policy(module, self.policy, self._device_type)
            self._hooked_module = module
        if self.fp8 is not None:
            self.fp8.install(module, self.policy)
        return module

    def connect(
        self, model: nn.Module, optimizers: list[Optimizer], lr_schedulers: list[Any]
    ) -> tuple[nn.Module, list[Optimizer], list[Any]]:
        """Check the optimizers, install FP32 masters or update rounding, hold LR schedulers on skips."""
        for opt in optimizers:
            check_optimizer(unwrap_optimizer(opt), self.recipe.name)
        root = self._lightning_module if self._lightning_module is not None else model
        if self.masters is not None and self.sharded is None:
            self.masters.install(root, [unwrap_optimizer(o) for o in optimizers])
            for path in self.pending_fp32_paths:
                self.keep_in_fp32(path)
            self.pending_fp32_paths = []
        if self.rounding is not None:
            self.rounding.install(root, [unwrap_optimizer(o) for o in optimizers])
        register_comm_hook(model, self.recipe.comm_dtype, self.comm_counter)
        if self._lightning_module is not None and lr_schedulers:
            self._hold.install(self._lightning_module)
        return model, optimizers, lr_schedulers

    # ----------------------------------------------------------------- steps
    def pre_backward(self, tensor: Tensor, module: Any) -> Tensor:  # type: ignore[override]
        """Multiply the loss by the current scale (when scaling is enabled), then run the hooks."""
        self.loss_scaler.to(tensor.device)
        return super().pre_backward(self.loss_scaler.scale(tensor), module)

    def optimizer_step(  # type: ignore[override]
        self, optimizer: Any, model: Any, closure: Callable[[], Any], **kwargs: Any
    ) -> Any:
        """Run the closure, unscale and check, then step (or skip) the optimizer and update the scale."""
        raw = unwrap_optimizer(optimizer)
        if isinstance(raw, LBFGS) and self.recipe.name == "32-true":
            return super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)
        check_optimizer(raw, self.recipe.name)
        closure_result = closure()
        if closure_result is None and getattr(model, "automatic_optimization", True):
            self._after_closure(model, raw)  # training_step returned None: no backward, no update
            self.loss_scaler.forget_step(raw)
            if self.fp8 is not None:
                self.fp8.discard_step()
            return None
        found_inf = self.loss_scaler.unscale_once(raw)
        if self.fp8 is not None:  # a non-finite FP8 amax skips the step like an overflow
            self.fp8.before_step(found_inf)
        self._after_closure(model, raw)
        step_output = self.loss_scaler.step(raw, **kwargs)
        self.loss_scaler.update()
        if self.fp8 is not None:  # the FP8 scales move on applied steps only (no host read)
            self.fp8.after_step(not self.loss_scaler.last_step_skipped(raw))
        return step_output

    def unscale_gradients(self, optimizer: Any) -> Tensor:
        """Unscale (under ``*-master``: onto the masters) ``optimizer``'s gradients; returns ``found_inf``.
        A second call before the step returns the first result (manual optimization may call it)."""
        return self.loss_scaler.unscale_once(optimizer)

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
            self.loss_scaler.unscale_once(optimizer)
        super().clip_gradients(unwrap_optimizer(optimizer), clip_val, gradient_clip_algorithm)

    def last_step_skipped(self, optimizer: Any | None = None) -> bool:
        """True when the latest step (of ``optimizer``, or of any) applied no update: under manual
        optimization, step your LR schedulers only when this is False."""
        return self.loss_scaler.last_step_skipped(optimizer)

    def latest_stats(self) -> dict[str, Tensor]:
        """Device tensors of the latest step (no sync): :meth:`TorchLossScaler.latest`."""
        return self.loss_scaler.latest()

    def autocast_context_manager(self) -> contextlib.AbstractContextManager:
        """``torch.autocast`` in the compute dtype (a null context for ``32-true``)."""
        if not self.recipe.low_precision:
            return contextlib.nullcontext()
        return torch.autocast(self._device_type, dtype=self.compute_dtype)

    @contextlib.contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        """Training/eval/predict forward passes run under the recipe's autocast."""
        with self.autocast_context_manager():
            yield

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
            self._policy_handle.add_region(module, path, self._device_type)
        for store in (self.masters, self.rounding):
            if store is not None:  # low-precision parameters re-stored in FP32 (from masters / w + c)
                store.store_fp32(module)
        if self.fp8 is not None:  # an FP32 region has no FP8 matmuls
            self.fp8.remove(path)
        return self.policy

    @property
    def root_module(self) -> nn.Module | None:
        """The model the recipe was applied to (None outside a fit)."""
        return self._hooked_module if self._hooked_module is not None else self._lightning_module

    # ------------------------------------------------------------ checkpoints
    def master_state_dict(self) -> dict[str, Tensor]:
        """``{parameter name: FP32 master}`` (empty unless ``*-master``)."""
        return self.masters.state_dict() if self.masters is not None else {}

    def state_dict(self) -> dict[str, Any]:
        """Plain data: recipe name, scaler record, FP32 masters, policy, rounding, FP8 (:mod:`lightning_ext.checkpoint`)."""
        return plugin_record(self)

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore a :meth:`state_dict`; another schema, recipe or scaler config is an error naming both."""
        load_plugin_record(self, state_dict)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """The checkpoint's model weights are the FP32 masters (``*-master``): what an FP32 model loads."""
        masters_as_weights(self, checkpoint)

    # --------------------------------------------------------------- teardown
    def teardown(self) -> None:
        """Remove the op-policy hooks and the LR-scheduler hold; keep masters and scaler state."""
        if self._policy_handle is not None:
            self._policy_handle.remove()
            self._policy_handle = None
        self._hooked_module = None
        self._hold.remove()
        if self.fp8 is not None:
            self.fp8.remove()
        self._lightning_module = None
        if self.masters is not None:
            self.masters.clear_cache()
