"""``lightning_ext.MixedPrecision``: the core's recipes as a Lightning precision plugin.

A drop-in for :class:`lightning.pytorch.plugins.precision.MixedPrecision`::

    trainer = Trainer(plugins=[MixedPrecision("bf16-master")])

What the plugin does per optimizer step (all decisions come from
:mod:`mp_callbacks`; this module only translates them to torch):

1. **Backward**: the loss is multiplied by the current scale (a 0-d float32
   tensor on the device), when the recipe's scaler is enabled.
2. **Gradients** (``*-master``): the low-precision gradient of every parameter
   that has an FP32 master is copied into the master's ``.grad`` (as FP32) and
   the low-precision ``.grad`` is released.
3. **Unscale + check** with ``torch._amp_foreach_non_finite_check_and_unscale_``
   over the optimizer's (master) gradients, using ``1/scale`` computed in
   float64 exactly as ``torch.amp.GradScaler`` does; the resulting
   ``found_inf`` is all-reduced (MAX) over the process group, so every rank
   takes the same decision.  With scaling off (bf16 and FP32 recipes) the
   check only feeds the overflow counter, so it runs when
   :func:`mp_callbacks.scaler.checks_overflow` says so: with a
   :class:`~lightning_ext.MixedPrecisionMonitor` attached, or
   ``count_overflows=True``; otherwise the step costs what Lightning's own
   plugin costs.
4. ``on_before_optimizer_step`` hooks and gradient clipping (norm or value) run
   on the unscaled FP32 gradients.
5. **Transition**: :func:`mp_callbacks.scaler.next_state` evaluated with
   :class:`~lightning_ext.torch_ops.TorchOps`; the state never leaves the device.
6. **Decision**: ``bool(applied)`` is the single host read of the step (as
   ``GradScaler.step`` does with ``found_inf.item()``); with scaling disabled
   (bf16 and FP32 recipes) it is known statically and nothing is read.
7. **Applied**: ``optimizer.step()``, then (``*-master``) every master is
   rounded back into its low-precision parameter (whose storage is released
   during the step: nothing reads it, and the step then holds no more than
   the recipe's 16 B/param budget for AdamW).  **Skipped**: nothing is
   called, so parameters, masters, optimizer slots and the optimizer's own step
   counters stay bit-for-bit unchanged.

LR schedulers on a skipped step: Lightning steps ``interval="step"``
schedulers after every optimizer step through the LightningModule hook
``lr_scheduler_step``.  While fitting, the plugin shadows that hook on the
LightningModule instance with a wrapper that calls the original hook (the
user's override or Lightning's default) only when the scheduler's optimizer
applied its last step; epoch-interval schedulers are never held.  The wrapper
is removed in :meth:`MixedPrecision.teardown`.  Under manual optimization the
user steps schedulers; :meth:`MixedPrecision.last_step_skipped` tells whether
to.  A ``training_step`` that returns ``None`` performs no optimizer update,
so the schedule is held too (the schedule counts applied updates).
"""

from __future__ import annotations

import contextlib
import warnings
from collections import defaultdict
from typing import Any, Callable, Generator, Iterable, Mapping, Optional, Union

import torch
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities import GradClipAlgorithmType
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import Tensor, nn
from torch.optim import LBFGS, Optimizer

from mp_callbacks.policy import PrecisionPolicy
from mp_callbacks.recipes import Recipe, RecipeError, canonical_recipe_name, get_recipe
from mp_callbacks.scaler import (
    ScaleFloorError,
    ScaleFloorWarning,
    ScalerConfig,
    ScalerState,
    StateDictError,
    check_state_dict,
    checks_overflow,
    floor_message,
    initial_state,
    make_state_dict,
    next_state,
    state_from_dict,
)

from .module_policy import ModulePolicyHandle, _Fp32Region, apply_module_policy, cast_module_storage, torch_dtype
from .torch_ops import TorchOps

__all__ = ["MixedPrecision", "LossScalerView", "PLUGIN_SCHEMA", "PLUGIN_SCHEMA_VERSION"]

PLUGIN_SCHEMA = "lightning_ext.MixedPrecision"
"""The ``schema`` tag of the plugin's checkpoint record."""
PLUGIN_SCHEMA_VERSION = 1
"""The version of the plugin's checkpoint record."""

_UNSUPPORTED_STRATEGIES = {
    "DeepSpeedStrategy": "DeepSpeed's own fp16/bf16 config: Trainer(strategy='deepspeed', precision='16-mixed')",
    "FSDPStrategy": "FSDP's mixed precision: Trainer(strategy='fsdp', precision='bf16-mixed')",
    "ModelParallelStrategy": "the strategy's own precision settings (torch FSDP2 MixedPrecisionPolicy)",
    "XLAStrategy": "Trainer(accelerator='tpu', precision='bf16-true')",
    "SingleDeviceXLAStrategy": "Trainer(accelerator='tpu', precision='bf16-true')",
}


def _scaler_config_from(value: Any) -> Optional[ScalerConfig]:
    """A ScalerConfig from a torch GradScaler (its settings), a config, a preset name, a dict or None."""
    if value is None:
        return None
    if isinstance(value, torch.amp.GradScaler):
        if not value.is_enabled():
            return ScalerConfig.preset("torch", enabled=False)
        return ScalerConfig.preset(
            "torch",
            init_scale=float(value.get_scale()),
            growth_factor=float(value.get_growth_factor()),
            backoff_factor=float(value.get_backoff_factor()),
            growth_interval=int(value.get_growth_interval()),
        )
    return ScalerConfig.coerce(value)


def _unwrap_optimizer(optimizer: Any) -> Any:
    return getattr(optimizer, "_optimizer", optimizer)


def check_strategy(strategy: Any) -> None:
    """Raise a clear error when ``strategy`` shards or re-implements precision handling.

    Supported: single-device strategies and DDP (``ddp``, ``ddp_spawn``...).
    """
    if strategy is None:
        return
    from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy

    for cls in type(strategy).__mro__:
        if cls.__name__ in _UNSUPPORTED_STRATEGIES:
            raise MisconfigurationException(
                f"lightning_ext.MixedPrecision does not support {type(strategy).__name__}: that strategy shards "
                f"parameters or optimizer state and brings its own precision handling. Use "
                f"{_UNSUPPORTED_STRATEGIES[cls.__name__]}, or keep this plugin with strategy='ddp' / a single device."
            )
    if not isinstance(strategy, (SingleDeviceStrategy, DDPStrategy)):
        raise MisconfigurationException(
            f"lightning_ext.MixedPrecision supports single-device and DDP strategies, not "
            f"{type(strategy).__name__}. Use strategy='ddp' (or 'ddp_spawn'), or the strategy's own precision."
        )


class LossScalerView:
    """What ``trainer.scaler`` shows: the GradScaler-like reading side of the plugin's scaler.

    Counters and :meth:`get_scale` read the device state back to the host (one
    sync each); :attr:`scale`, :attr:`found_inf` and :meth:`latest` return
    device tensors without syncing.
    """

    def __init__(self, plugin: "MixedPrecision") -> None:
        self._plugin = plugin

    @property
    def config(self) -> ScalerConfig:
        """The scaler configuration in use."""
        return self._plugin.recipe.scaler

    @property
    def state(self) -> ScalerState:
        """The current :class:`~mp_callbacks.scaler.ScalerState` (0-d device tensors)."""
        return self._plugin._state

    def is_enabled(self) -> bool:
        """True when the loss is scaled (as ``GradScaler.is_enabled``)."""
        return self.config.enabled

    def get_scale(self) -> float:
        """The current loss scale as a Python float (1.0 when scaling is disabled)."""
        return float(self.state.scale.item())

    @property
    def scale(self) -> Tensor:
        """The current loss scale (0-d float32 tensor, no sync)."""
        return self.state.scale

    @property
    def grad_scale(self) -> Tensor:
        """The scale the current gradients were produced with (0-d tensor, no sync).

        Differs from :attr:`scale` after an earlier optimizer updated the scaler
        since the last backward (several optimizers stepping after one backward).
        """
        used = self._plugin._grad_scale
        return used if used is not None else self.state.scale

    @property
    def found_inf(self) -> Optional[Tensor]:
        """Whether the latest step's gradients were non-finite (0-d bool tensor), None before any step."""
        return self._plugin._last_overflow

    def _counter(self, name: str) -> int:
        return int(getattr(self.state, name).item())

    @property
    def steps(self) -> int:
        """Scaler transitions (optimizer steps seen)."""
        return self._counter("steps")

    @property
    def overflows(self) -> int:
        """Steps whose gradients held inf/NaN."""
        return self._counter("overflows")

    @property
    def skipped(self) -> int:
        """Steps whose update was skipped."""
        return self._counter("skipped")

    @property
    def growths(self) -> int:
        """Times the scale grew."""
        return self._counter("growths")

    @property
    def floor_hits(self) -> int:
        """Overflows while the scale sat at ``min_scale``."""
        return self._counter("floor_hits")

    def latest(self) -> dict[str, Tensor]:
        """StepStats-ready tensors of the latest step, no host sync (see :meth:`MixedPrecision.latest_stats`)."""
        return self._plugin.latest_stats()

    def state_dict(self) -> dict[str, Any]:
        """The scaler's versioned plain-data record (host sync)."""
        return make_state_dict(self.config, self.state)

    def __repr__(self) -> str:
        return f"LossScalerView(config={self.config!r})"


class MixedPrecision(Precision):
    """Mixed-precision training for Lightning driven by the :mod:`mp_callbacks` core.

    Args:
      precision: a recipe: ``"32-true"``, ``"16-mixed"``, ``"bf16-mixed"``,
        ``"16-master"`` or ``"bf16-master"`` (aliases such as ``"bf16"`` or
        ``"mixed_float16"`` are accepted).
      device: the device type for ``torch.autocast`` (``"cpu"``, ``"cuda"``...).
      scaler: the loss scaler: a ``torch.amp.GradScaler`` (its settings are
        taken), a :class:`~mp_callbacks.scaler.ScalerConfig`, a preset name
        (``"torch"``, ``"megatron"``...), a dict of fields, or ``None`` for the
        recipe's default (dynamic ``torch`` preset for fp16, off for bf16/fp32).
      policy: the operator policy (a :class:`~mp_callbacks.policy.PrecisionPolicy`,
        a policy string or dict), or ``None`` for the recipe's.
      count_overflows: with scaling off, whether every step looks for inf/NaN
        gradients to count them (``scaler.overflows``); ``None`` (default):
        only while a :class:`~lightning_ext.MixedPrecisionMonitor` is attached.
        With scaling on the check always runs (it decides the skip).
      free_weights_during_step: ``*-master`` only: release the low-precision
        weights' storage while ``optimizer.step()`` updates the masters and
        rebuild them from the masters right after (the step then holds 16
        B/param for AdamW instead of 18).  Set False if an optimizer step hook
        of yours reads the module's weights.

    Raises:
      RecipeError: an unknown recipe name (the message lists the valid ones).

    Example::

        Trainer(plugins=[MixedPrecision("16-mixed", "cuda", scaler="megatron")])
    """

    def __init__(
        self,
        precision: str = "bf16-mixed",
        device: Union[str, torch.device] = "cpu",
        scaler: Union[torch.amp.GradScaler, ScalerConfig, str, Mapping[str, Any], None] = None,
        policy: Union[PrecisionPolicy, str, Mapping[str, Any], None] = None,
        count_overflows: Optional[bool] = None,
        free_weights_during_step: bool = True,
    ) -> None:
        try:
            name = canonical_recipe_name(precision)
        except RecipeError as exc:
            hint = ""
            if isinstance(precision, str) and precision.endswith("-true") and precision != "32-true":
                hint = (
                    f" For Lightning's pure {precision} use Trainer(precision={precision!r}); the recipe with "
                    f"FP32 master weights is {precision.replace('-true', '-master')!r}."
                )
            raise RecipeError(f"lightning_ext.MixedPrecision: {exc}.{hint}") from None
        self.recipe: Recipe = get_recipe(name, scaler=_scaler_config_from(scaler), policy=policy)
        self.precision = self.recipe.name  # type: ignore[assignment]
        if count_overflows is not None and not isinstance(count_overflows, bool):
            raise TypeError(f"count_overflows must be True, False or None, not {count_overflows!r}")
        self.count_overflows = count_overflows
        self.monitored = False  # set by MixedPrecisionMonitor while it is attached
        self.free_weights_during_step = bool(free_weights_during_step)
        self.device = str(device)
        self._device_type = torch.device(device).type
        self._ops = TorchOps("cpu")
        self._state: ScalerState = initial_state(self.recipe.scaler, self._ops)
        self._grad_scale: Optional[Tensor] = None
        self._last_overflow: Optional[Tensor] = None
        self._last_applied_t: Optional[Tensor] = None
        self._last_scale: Optional[Tensor] = None
        self._applied_by_opt: dict[int, bool] = {}
        self._last_applied: Optional[bool] = None
        self._unscaled: dict[int, Tensor] = {}
        # id(low-precision param) -> (name, low param, FP32 master Parameter)
        self._masters: dict[int, tuple[str, nn.Parameter, nn.Parameter]] = {}
        self._entries_cache: dict[int, tuple[Any, list[tuple[str, nn.Parameter, nn.Parameter]]]] = {}
        self._originals: dict[str, Tensor] = {}
        self._pending_masters: Optional[dict[str, Tensor]] = None
        self._pending_fp32_paths: list[str] = []
        self._policy_handle: Optional[ModulePolicyHandle] = None
        self._hooked_module: Optional[nn.Module] = None
        self._lightning_module: Any = None
        self.scaler = LossScalerView(self)

    # ---------------------------------------------------------------- properties
    @property
    def policy(self) -> PrecisionPolicy:
        """The operator precision policy in use."""
        return self.recipe.policy

    @property
    def master_weights(self) -> bool:
        """True for ``*-master`` recipes (FP32 master copies inside the optimizer)."""
        return self.recipe.master.master_weights

    @property
    def compute_dtype(self) -> torch.dtype:
        """The low-precision compute dtype (float32 for ``32-true``)."""
        return torch_dtype(self.recipe.policy.compute)

    @property
    def can_skip(self) -> bool:
        """True when a step can be skipped (scaling enabled): then the decision costs one host read."""
        return self.recipe.scaler.enabled

    @property
    def checks_overflow(self) -> bool:
        """True when steps look for inf/NaN gradients (:func:`mp_callbacks.scaler.checks_overflow`).

        Always with scaling on; with scaling off when ``count_overflows=True``
        or a :class:`~lightning_ext.MixedPrecisionMonitor` is attached.  Steps
        that do not check count no overflows.
        """
        return checks_overflow(self.recipe.scaler, self.count_overflows, self.monitored)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(precision={self.precision!r}, device={self.device!r})"

    # ------------------------------------------------------------------ device
    def _ensure_device(self, device: torch.device) -> None:
        if self._state.scale.device != device:
            self._ops = TorchOps(device)
            self._state = ScalerState(*(t.to(device) for t in self._state))

    # ---------------------------------------------------------- module / setup
    def convert_module(self, module: nn.Module) -> nn.Module:
        """Apply the recipe to the model: parameter storage (``*-master``) and FP32-op hooks."""
        trainer = getattr(module, "_trainer", None)
        strategy = getattr(trainer, "strategy", None) if trainer is not None else None
        if strategy is not None:
            check_strategy(strategy)
            root = getattr(strategy, "root_device", None)
            if isinstance(root, torch.device) and root.type != self._device_type and self.recipe.low_precision:
                warnings.warn(
                    f"MixedPrecision(device={self.device!r}) but the model trains on {root}: autocast follows the "
                    f"training device, {root.type!r}. Pass device={root.type!r} to silence this warning.",
                    stacklevel=2,
                )
                self._device_type = root.type
        self._lightning_module = module
        if self.master_weights:
            low = torch_dtype(self.recipe.master.param_dtype)
            known = {id(low_p): master for _, low_p, master in self._masters.values()}
            named = dict(module.named_parameters())
            originals = cast_module_storage(module, self.policy, low)
            for pname, fp32 in originals.items():
                param = named.get(pname)
                master = known.get(id(param)) if param is not None else None
                if master is not None and torch.equal(master.detach().to(low), param.detach()):
                    fp32 = master.detach().clone()  # keep the precision of an earlier fit
                self._originals[pname] = fp32
        if self.recipe.low_precision and self._hooked_module is not module:
            if self._policy_handle is not None:
                self._policy_handle.remove()
            self._policy_handle = apply_module_policy(module, self.policy, self._device_type)
            self._hooked_module = module
        return module

    def connect(
        self, model: nn.Module, optimizers: list[Optimizer], lr_schedulers: list[Any]
    ) -> tuple[nn.Module, list[Optimizer], list[Any]]:
        """Check the optimizers, swap FP32 masters into their param groups, hold LR schedulers on skips."""
        for opt in optimizers:
            self._check_optimizer(_unwrap_optimizer(opt))
        if self.master_weights:
            self._install_masters(model, [_unwrap_optimizer(o) for o in optimizers])
        module = self._lightning_module
        if module is not None and lr_schedulers:
            self._wrap_scheduler_hook(module)
        return model, optimizers, lr_schedulers

    def _check_optimizer(self, optimizer: Any) -> None:
        if isinstance(optimizer, LBFGS) and self.recipe.name != "32-true":
            raise MisconfigurationException(
                f"lightning_ext.MixedPrecision({self.recipe.name!r}) does not support LBFGS: it re-evaluates "
                "the closure inside step(), so loss scaling, overflow skipping and master weights cannot wrap "
                "it. Use a first-order optimizer (SGD, Adam, AdamW) with this recipe, or "
                "MixedPrecision('32-true') / Trainer(precision='32-true') for LBFGS."
            )

    def _install_masters(self, model: nn.Module, optimizers: list[Optimizer]) -> None:
        root = self._lightning_module if self._lightning_module is not None else model
        names = {id(p): n for n, p in root.named_parameters()}
        pending = self._pending_masters or {}
        for opt in optimizers:
            for group in opt.param_groups:
                params = group["params"]
                for i, p in enumerate(params):
                    if p.dtype == torch.float32:
                        continue  # FP32-kept parameters are their own master
                    entry = self._masters.get(id(p))
                    if entry is None or entry[1] is not p:
                        name = names.get(id(p), f"<unnamed {len(self._masters)}>")
                        original = self._originals.pop(name, None)
                        value = pending.get(name, original)
                        if value is None:
                            value = p.detach().float()
                        value = value.detach().to(device=p.device, dtype=torch.float32)
                        if value is not original:
                            value = value.clone()
                        master = nn.Parameter(value, requires_grad=p.requires_grad)
                        entry = (name, p, master)
                        self._masters[id(p)] = entry
                    else:
                        # A later fit: convert_module recorded the parameter's current FP32
                        # value (the master itself unless the user changed the weights).
                        fresh = pending.get(entry[0], self._originals.pop(entry[0], None))
                        if fresh is not None:
                            with torch.no_grad():
                                entry[2].copy_(fresh)
                    master = entry[2]
                    params[i] = master
                    if p in opt.state:  # move existing optimizer state onto the master
                        opt.state[master] = {
                            k: (v.float() if isinstance(v, Tensor) and v.is_floating_point() and v.dim() else v)
                            for k, v in opt.state.pop(p).items()
                        }
        self._pending_masters = None
        self._entries_cache.clear()
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            # DDP broadcast rank 0's low-precision weights; masters must follow rank 0 too.
            with torch.no_grad():
                for _, _, master in self._masters.values():
                    dist.broadcast(master.data, src=0)
        self._copy_masters_to_params(e for e in self._masters.values())
        for path in self._pending_fp32_paths:
            self.keep_in_fp32(path)
        self._pending_fp32_paths = []

    @staticmethod
    def _copy_masters_to_params(entries: Iterable[tuple[str, nn.Parameter, nn.Parameter]]) -> None:
        lows, masters = [], []
        for _, low, master in entries:
            lows.append(low)
            masters.append(master)
        if lows:
            with torch.no_grad():
                torch._foreach_copy_(lows, masters)  # one fused, rounding copy per step

    @staticmethod
    def _release_weights(entries: Iterable[tuple[str, nn.Parameter, nn.Parameter]]) -> list[tuple[Any, int]]:
        """Free the storage of low-precision weights that the masters rebuild after the step.

        During ``optimizer.step()`` nothing reads them (the update runs on the
        masters), so the step holds FP32 grads + masters + optimizer state
        only: 16 B/param for AdamW under ``bf16-master``, as the recipe's memory
        budget says.  A weight is released only when it owns its whole storage
        (no view of a larger buffer) and that storage can be resized.
        Returns ``(storage, nbytes)`` to restore with ``storage.resize_(nbytes)``.
        """
        released: list[tuple[Any, int]] = []
        for _, low, master in entries:
            if low is master or low.storage_offset() != 0 or not low.is_contiguous():
                continue
            storage = low.untyped_storage()
            nbytes = storage.nbytes()
            if nbytes != low.numel() * low.element_size() or nbytes == 0 or not storage.resizable():
                continue
            storage.resize_(0)
            released.append((storage, nbytes))
        return released

    def _master_entries(self, optimizer: Optimizer) -> list[tuple[str, nn.Parameter, nn.Parameter]]:
        """The master entries whose FP32 master ``optimizer`` updates (cached per step layout)."""
        groups = optimizer.param_groups
        key = (len(self._masters), len(groups), tuple(id(g["params"]) for g in groups),
               sum(len(g["params"]) for g in groups))
        cached = self._entries_cache.get(id(optimizer))
        if cached is not None and cached[0] == key:
            return cached[1]
        in_opt = {id(p) for g in groups for p in g["params"]}
        entries = [e for e in self._masters.values() if id(e[2]) in in_opt]
        self._entries_cache[id(optimizer)] = (key, entries)
        return entries

    # --------------------------------------------------------- LR scheduler hold
    def _wrap_scheduler_hook(self, module: Any) -> None:
        if "lr_scheduler_step" in vars(module) and getattr(vars(module)["lr_scheduler_step"], "_mp_wrapped", False):
            return
        original = module.lr_scheduler_step
        plugin = self

        def lr_scheduler_step(scheduler: Any, metric: Any = None) -> Any:
            if plugin._holds_scheduler(module, scheduler):
                return None
            return original(scheduler, metric)

        lr_scheduler_step._mp_wrapped = True  # type: ignore[attr-defined]
        lr_scheduler_step.__doc__ = "lightning_ext: holds step-interval schedulers on skipped optimizer steps."
        object.__setattr__(module, "lr_scheduler_step", lr_scheduler_step)

    def _unwrap_scheduler_hook(self) -> None:
        module = self._lightning_module
        if module is not None and getattr(vars(module).get("lr_scheduler_step"), "_mp_wrapped", False):
            del module.__dict__["lr_scheduler_step"]

    def _holds_scheduler(self, module: Any, scheduler: Any) -> bool:
        trainer = getattr(module, "_trainer", None)
        configs = getattr(trainer, "lr_scheduler_configs", None) or []
        interval = next((c.interval for c in configs if c.scheduler is scheduler), "step")
        if interval != "step":
            return False
        opt = getattr(scheduler, "optimizer", None)
        if opt is not None and id(opt) in self._applied_by_opt:
            return not self._applied_by_opt[id(opt)]
        return self._last_applied is False

    def last_step_skipped(self, optimizer: Optional[Any] = None) -> bool:
        """True when the latest step (of ``optimizer``, or of any optimizer) applied no update.

        Under manual optimization, step your LR schedulers only when this is False.
        """
        if optimizer is not None:
            return not self._applied_by_opt.get(id(_unwrap_optimizer(optimizer)), True)
        return self._last_applied is False

    # --------------------------------------------------------------- contexts
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

    # --------------------------------------------------------------- backward
    def pre_backward(self, tensor: Tensor, module: Any) -> Tensor:  # type: ignore[override]
        """Multiply the loss by the current scale (when scaling is enabled), then run the hooks."""
        self._ensure_device(tensor.device)
        if self.recipe.scaler.enabled:
            self._grad_scale = self._state.scale
            tensor = tensor * self._state.scale
        return super().pre_backward(tensor, module)

    # ----------------------------------------------------------------- unscale
    def unscale_gradients(self, optimizer: Any) -> Tensor:
        """Move grads to masters, unscale them in place and return ``found_inf`` (0-d float32, all-reduced).

        Called by :meth:`optimizer_step` and before clipping; calling it yourself
        (manual optimization) before inspecting gradients is allowed: a second
        call before the step is a no-op.  When the step does not check
        (:attr:`checks_overflow` is False: scaling off, no monitor) ``found_inf``
        is 0 without looking at the gradients.
        """
        optimizer = _unwrap_optimizer(optimizer)
        done = self._unscaled.get(id(optimizer))
        if done is not None:
            return done
        device = self._state.scale.device
        with torch.no_grad():
            if self._masters:
                self._grads_to_masters(self._master_entries(optimizer))
            if self.checks_overflow:
                found_inf = self._check_and_unscale(optimizer, device)
            else:
                found_inf = torch.zeros((), dtype=torch.float32, device=device)
        self._unscaled[id(optimizer)] = found_inf
        return found_inf

    @staticmethod
    def _grads_to_masters(entries: Iterable[tuple[str, nn.Parameter, nn.Parameter]]) -> None:
        """Each low-precision gradient becomes its master's FP32 gradient; the low one is released."""
        reuse_dst, reuse_src = [], []
        for _, low, master in entries:
            if low.grad is None:
                continue
            if master.grad is None or master.grad.shape != master.shape:
                master.grad = low.grad.to(torch.float32)
            else:
                reuse_dst.append(master.grad)
                reuse_src.append(low.grad)
            low.grad = None
        if reuse_dst:
            torch._foreach_copy_(reuse_dst, reuse_src)
            reuse_src.clear()

    def _check_and_unscale(self, optimizer: Optimizer, device: torch.device) -> Tensor:
        """``found_inf`` of the optimizer's gradients, unscaled in place by ``1/scale`` (GradScaler's kernel)."""
        groups: dict[tuple[torch.device, torch.dtype], list[Tensor]] = defaultdict(list)
        for group in optimizer.param_groups:
            for p in group["params"]:
                grad = p.grad
                if grad is None:
                    continue
                if grad.is_sparse:
                    if grad.dtype is torch.float16:
                        p.grad = grad = grad.coalesce()
                    grad = grad._values()
                groups[(grad.device, grad.dtype)].append(grad)
        if self.recipe.scaler.enabled:
            scale = self._grad_scale if self._grad_scale is not None else self._state.scale
            inv_scale = scale.double().reciprocal().float()
        else:
            inv_scale = torch.ones((), dtype=torch.float32, device=device)
        found_inf = torch.zeros((), dtype=torch.float32, device=device)
        for (dev, _), grads in groups.items():
            local = found_inf if dev == device else torch.zeros((), dtype=torch.float32, device=dev)
            torch._amp_foreach_non_finite_check_and_unscale_(grads, local, inv_scale.to(dev))
            if local is not found_inf:
                found_inf = found_inf + local.to(device)
        if self.recipe.scaler.enabled:
            # Every rank must take the same skip decision.  With scaling off nothing is
            # decided (every step is applied), so no collective: the count stays per rank.
            found_inf = self._all_reduce_max(found_inf)
        return found_inf

    @staticmethod
    def _all_reduce_max(flag: Tensor) -> Tensor:
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return flag

    # -------------------------------------------------------------- optimizer
    def optimizer_step(  # type: ignore[override]
        self,
        optimizer: Any,
        model: Any,
        closure: Callable[[], Any],
        **kwargs: Any,
    ) -> Any:
        """Run the closure, unscale and check, decide with the core, then step (or skip) the optimizer."""
        raw = _unwrap_optimizer(optimizer)
        if isinstance(raw, LBFGS):
            if self.recipe.name == "32-true":
                return super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)
            self._check_optimizer(raw)
        closure_result = closure()
        automatic = getattr(model, "automatic_optimization", True)
        if closure_result is None and automatic:
            # training_step returned None: no backward, nothing to unscale or step.
            self._after_closure(model, raw)
            self._unscaled.pop(id(raw), None)
            self._applied_by_opt[id(raw)] = False
            self._last_applied = False
            return None

        found_inf = self.unscale_gradients(raw)
        self._after_closure(model, raw)
        config = self.recipe.scaler
        old = self._state
        overflow = found_inf > 0
        new, applied_t = next_state(config, old, overflow, self._ops)
        applied = bool(applied_t.item()) if config.enabled else True  # the one host read of the step
        self._state = new
        used = self._grad_scale if (config.enabled and self._grad_scale is not None) else old.scale
        self._last_overflow, self._last_applied_t, self._last_scale = overflow, applied_t, used
        self._unscaled.pop(id(raw), None)
        retval = None
        if applied:
            if self._masters:
                entries = self._master_entries(raw)
                released = self._release_weights(entries) if self.free_weights_during_step else []
                try:
                    retval = raw.step(**kwargs)
                finally:  # also when the optimizer fails: the weights always come back from the masters
                    if released:
                        # The FP32 grads are spent: drop them before the weights come back, so that
                        # the step's end holds no more than its middle (zero_grad would drop them
                        # only at the next step).
                        for _, _, master in entries:
                            master.grad = None
                        for storage, nbytes in released:
                            storage.resize_(nbytes)
                    self._copy_masters_to_params(entries)
            else:
                retval = raw.step(**kwargs)
        elif config.on_min_scale != "clamp" and int(new.floor_hits.item()) > int(old.floor_hits.item()):
            message = floor_message(int(new.steps.item()), float(new.scale.item()), config)
            if config.on_min_scale == "raise":
                raise ScaleFloorError(message)
            warnings.warn(message, ScaleFloorWarning, stacklevel=2)
        self._applied_by_opt[id(raw)] = applied
        self._last_applied = applied
        return retval

    def clip_gradients(
        self,
        optimizer: Optimizer,
        clip_val: Union[int, float] = 0.0,
        gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM,
    ) -> None:
        """Clip the unscaled FP32 (master) gradients; unscales first when not done yet (manual optimization)."""
        if clip_val and clip_val > 0:
            self.unscale_gradients(optimizer)
        super().clip_gradients(_unwrap_optimizer(optimizer), clip_val, gradient_clip_algorithm)

    # ------------------------------------------------------ runtime FP32 moves
    def keep_in_fp32(self, path: str, module: Optional[nn.Module] = None) -> PrecisionPolicy:
        """Move the module at dotted ``path`` to FP32 now; training continues.

        The policy becomes ``policy.with_fp32_modules(path)`` (so a later
        ``convert_module`` and the checkpointed policy keep it), and the module
        gets the same FP32 region hooks :func:`~lightning_ext.module_policy.apply_module_policy`
        installs (autocast off, floating inputs cast to FP32), removed in
        :meth:`teardown`.  Under ``*-master`` its low-precision parameters and
        buffers are re-stored in FP32 (parameters from their FP32 masters, which
        keep driving the update).  Idempotent.  Returns the new policy.

        Args:
          path: the module's dotted name in the LightningModule (``"net.1"``).
          module: the module object; looked up from ``path`` when omitted.
        """
        if not isinstance(path, str) or not path:
            raise ValueError(f"keep_in_fp32 needs a non-empty dotted module path, not {path!r}")
        self.recipe = self.recipe.with_policy(self.recipe.policy.with_fp32_modules(path))
        root = self._hooked_module if self._hooked_module is not None else self._lightning_module
        if module is None:
            if root is None:
                return self.policy  # not fitting yet: convert_module applies the rule
            module = root.get_submodule(path)
        if self.recipe.low_precision and self._policy_handle is not None and path not in self._policy_handle.paths:
            region = _Fp32Region(self._device_type)
            self._policy_handle.handles.append(module.register_forward_pre_hook(region.pre_hook, with_kwargs=True))
            self._policy_handle.handles.append(
                module.register_forward_hook(region.post_hook, with_kwargs=True, always_call=True))
            self._policy_handle.paths.append(path)
        if self.master_weights:
            with torch.no_grad():
                for param in module.parameters():
                    if param.is_floating_point() and param.dtype != torch.float32:
                        entry = self._masters.get(id(param))
                        source = entry[2] if entry is not None and entry[1] is param else param
                        param.data = source.detach().to(torch.float32, copy=True)
                for sub in module.modules():
                    for name, buf in sub.named_buffers(recurse=False):
                        if buf is not None and buf.is_floating_point() and buf.dtype != torch.float32:
                            sub._buffers[name] = buf.float()
        return self.policy

    def _restore_policy(self, saved: Any) -> None:
        """Re-apply FP32 module rules the checkpointed policy added (e.g. by auto-fallback).

        A checkpoint whose policy has other dtypes is an error naming both.
        """
        if saved is None:
            return
        try:
            saved_policy = PrecisionPolicy.from_dict(saved)
        except (ValueError, TypeError) as exc:
            raise StateDictError(f"the checkpoint holds an invalid policy: {exc}") from None
        if (saved_policy.params, saved_policy.compute) != (self.policy.params, self.policy.compute):
            raise StateDictError(
                f"the checkpoint was saved with policy {saved_policy.format()!r}; this trainer uses "
                f"{self.policy.format()!r}"
            )
        for pattern, dtype in saved_policy.module_rules:
            if dtype != "float32" or (pattern, dtype) in self.policy.module_rules:
                continue
            root = self._hooked_module if self._hooked_module is not None else self._lightning_module
            try:
                module = root.get_submodule(pattern) if root is not None else None
            except AttributeError:
                module = None  # a class name or a glob: a policy rule only
            if module is None:
                self.recipe = self.recipe.with_policy(self.recipe.policy.with_fp32_modules(pattern))
            elif self.master_weights and not self._masters:
                self.recipe = self.recipe.with_policy(self.recipe.policy.with_fp32_modules(pattern))
                self._pending_fp32_paths.append(pattern)  # after the masters exist
            else:
                self.keep_in_fp32(pattern, module)

    # ----------------------------------------------------------- diagnostics
    def latest_stats(self) -> dict[str, Tensor]:
        """StepStats-ready device tensors of the latest step (no host sync).

        Keys: ``scale`` (the scale the step's gradients were produced with),
        ``next_scale``, ``overflow`` and ``applied`` (bool), and the running
        counters ``steps``, ``overflows_total``, ``skipped_total``,
        ``growths_total``.  Empty before the first step.
        """
        if self._last_overflow is None:
            return {}
        s = self._state
        return {
            "scale": self._last_scale, "next_scale": s.scale, "overflow": self._last_overflow,
            "applied": self._last_applied_t, "steps": s.steps, "overflows_total": s.overflows,
            "skipped_total": s.skipped, "growths_total": s.growths,
        }

    # ------------------------------------------------------------ checkpoints
    def master_state_dict(self) -> dict[str, Tensor]:
        """``{parameter name: FP32 master}`` (empty unless ``*-master``)."""
        return {name: master.detach() for name, _, master in self._masters.values()}

    def state_dict(self) -> dict[str, Any]:
        """Plain data: recipe name, scaler record (config + state + counters), FP32 masters, policy."""
        return {
            "schema": PLUGIN_SCHEMA,
            "schema_version": PLUGIN_SCHEMA_VERSION,
            "recipe": self.recipe.name,
            "scaler": make_state_dict(self.recipe.scaler, self._state),
            "masters": self.master_state_dict(),
            "policy": self.recipe.policy.to_dict(),
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore a :meth:`state_dict`; another schema, recipe or scaler config is an error naming both."""
        here = f"lightning_ext.MixedPrecision({self.recipe.name!r}) schema v{PLUGIN_SCHEMA_VERSION}"
        if not isinstance(state_dict, Mapping) or state_dict.get("schema") != PLUGIN_SCHEMA:
            if isinstance(state_dict, Mapping) and "scale" in state_dict and "_growth_tracker" in state_dict:
                saved = "a torch GradScaler state (Lightning's native MixedPrecision plugin)"
            else:
                keys = sorted(state_dict) if isinstance(state_dict, Mapping) else type(state_dict).__name__
                saved = f"an unknown precision-plugin state ({keys})"
            raise StateDictError(f"the checkpoint holds {saved}; this trainer uses {here}")
        version, recipe = state_dict.get("schema_version"), state_dict.get("recipe")
        if version != PLUGIN_SCHEMA_VERSION:
            raise StateDictError(f"the checkpoint holds plugin schema v{version!r} (recipe {recipe!r}); this trainer uses {here}")
        if recipe != self.recipe.name:
            raise StateDictError(
                f"the checkpoint was saved with recipe {recipe!r}; this trainer uses {here}. Resume with "
                f"MixedPrecision({recipe!r}) or start a new run."
            )
        plain = check_state_dict(self.recipe.scaler, state_dict["scaler"])
        self._restore_policy(state_dict.get("policy"))
        self._state = state_from_dict(plain, self._ops)
        masters = state_dict.get("masters") or {}
        if not isinstance(masters, Mapping):
            raise StateDictError(f"the checkpoint's 'masters' must be a dict of tensors, not {type(masters).__name__}")
        if not self.master_weights:
            return
        if not self._masters:
            self._pending_masters = {k: v for k, v in masters.items()}
            return
        current = {e[0]: e for e in self._masters.values()}
        missing, unexpected = sorted(set(current) - set(masters)), sorted(set(masters) - set(current))
        if missing or unexpected:
            raise StateDictError(
                f"the checkpoint's master weights do not match the model: missing {missing}, unexpected {unexpected}"
            )
        with torch.no_grad():
            for name, (_, low, master) in current.items():
                value = masters[name]
                if not isinstance(value, Tensor) or value.shape != master.shape:
                    raise StateDictError(f"master weight {name!r} has shape {getattr(value, 'shape', None)}, "
                                         f"the model's is {tuple(master.shape)}")
                master.copy_(value)
                low.copy_(master)

    # --------------------------------------------------------------- teardown
    def teardown(self) -> None:
        """Remove the op-policy hooks and the LR-scheduler hold; keep masters and scaler state."""
        if self._policy_handle is not None:
            self._policy_handle.remove()
            self._policy_handle = None
        self._hooked_module = None
        self._unwrap_scheduler_hook()
        self._lightning_module = None
        self._unscaled.clear()
        self._entries_cache.clear()
