"""``TorchLossScaler``: the core's loss scaler with torch ``GradScaler``'s public API.

What ``trainer.scaler`` returns for recipes that scale the loss.  The state
(:class:`~mp_callbacks.loss_scale.ScalerState`) lives in 0-d tensors on the
training device and moves only by :func:`mp_callbacks.loss_scale.next_state`
evaluated with :class:`~lightning_ext.ops.TorchOps`.  The protocol is
``GradScaler``'s::

    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)        # optional: before clipping or reading grads
    scaler.step(optimizer)            # skipped when the gradients are not finite
    scaler.update()                   # one scaler transition

Per optimizer, a stage guards the order (``READY`` -> ``UNSCALED`` ->
``STEPPED``, back to ``READY`` at :meth:`~TorchLossScaler.update`): unscaling
twice or after the step is an error, as in torch.  Rules:

* ``unscale_``: when the step checks for overflows (:attr:`~TorchLossScaler.checks_overflow`,
  the core's :func:`~mp_callbacks.loss_scale.checks_overflow`), the optimizer's gradients,
  grouped per device and dtype, go through torch's fused
  ``_amp_foreach_non_finite_check_and_unscale_`` with the inverse scale ``GradScaler`` uses
  (the float64 reciprocal of the scale, rounded to float32; 1 with scaling off), which sets
  ``found_inf``; when the step can be skipped the flag is all-reduced (MAX) over the process
  group, so every rank decides alike (under FSDP2 each rank checks its local gradient shards:
  ``ShardedGradScaler``'s semantics).  Nothing else touches the gradients: moving them onto
  FP32 masters first is the plugin's job.
* ``step``: the decision (:meth:`~TorchLossScaler.skips`: one host read of ``found_inf``
  where the step can be skipped, as ``GradScaler.step``; none otherwise), then
  ``optimizer.step()`` unless skipped.  A skipped step calls nothing.
* ``update``: the divergence rule sees the step (:class:`~lightning_ext.loss_scale.divergence.TorchDivergence`),
  then one transition with the flags of every optimizer unscaled since the last update; a
  floor hit reacts per ``on_min_scale`` (:func:`~mp_callbacks.loss_scale.react_to_floor_hit`).

With scaling disabled (bf16 and FP32 recipes) the same object checks (and, with
``skip_nonfinite``, skips) and counts overflows; the plugin then exposes it as ``loss_scaler``
only and ``plugin.scaler`` is None, as in Lightning.  It is a ``torch.amp.GradScaler`` for
``isinstance`` checks (Lightning's, users'), not built on one: no ``GradScaler`` method runs
unless this class defines it.
"""

from __future__ import annotations

import enum
from collections import defaultdict
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import Tensor

from mp_callbacks.diagnostics import MonitorPort
from mp_callbacks.loss_scale import (
    ScalerConfig,
    ScalerCounters,
    ScalerState,
    check_state_dict,
    initial_state,
    make_state_dict,
    next_state,
    react_to_floor_hit,
    state_from_dict,
)

from ..ops import TorchOps
from .divergence import TorchDivergence

__all__ = ["OptState", "TorchLossScaler", "scaler_config_from", "unscale_and_check", "unwrap_optimizer"]


class OptState(enum.Enum):
    """Where an optimizer is in the scale -> unscale -> step -> update cycle."""

    READY = 0
    UNSCALED = 1
    STEPPED = 2


_READY = (OptState.READY, None)


def scaler_config_from(value: Any) -> ScalerConfig | None:
    """A ScalerConfig from a torch ``GradScaler`` (its settings), a config, a preset name, a dict, or None."""
    if value is None:
        return None
    if isinstance(value, TorchLossScaler):
        return value.config
    if isinstance(value, torch.amp.GradScaler):
        if not value.is_enabled():
            return ScalerConfig.preset("torch", enabled=False)
        return ScalerConfig.preset(
            "torch", init_scale=float(value.get_scale()), growth_factor=float(value.get_growth_factor()),
            backoff_factor=float(value.get_backoff_factor()), growth_interval=int(value.get_growth_interval()))
    return ScalerConfig.coerce(value)


def unwrap_optimizer(optimizer: Any) -> Any:
    """The torch optimizer behind Lightning's ``LightningOptimizer`` (or Fabric's ``_FabricOptimizer``): the
    wrapper's own ``_optimizer`` attribute only (a ``Mock`` would make one up on access)."""
    return getattr(optimizer, "__dict__", {}).get("_optimizer", optimizer)


def unscale_and_check(optimizer: Any, inv_scale: Tensor, device: torch.device) -> Tensor:
    """Multiply every gradient of ``optimizer`` by ``inv_scale`` in place and return ``found_inf`` (a 0-d float32
    tensor on ``device``: 1 when a value is inf or NaN, else 0).

    ``GradScaler._unscale_grads_``'s rule: the gradients grouped per device and dtype, one
    ``torch._amp_foreach_non_finite_check_and_unscale_`` call per group; a DTensor's (FSDP2 shard's) local
    shard; a sparse gradient's values (a float16 one coalesced first).  An object without a list of
    ``param_groups`` (a test double) has no gradients.
    """
    groups: dict[tuple[torch.device, torch.dtype], list[Tensor]] = defaultdict(list)
    param_groups = getattr(optimizer, "param_groups", None)
    for group in param_groups if isinstance(param_groups, (list, tuple)) else ():
        for p in group["params"]:
            grad = p.grad
            if grad is None:
                continue
            if hasattr(grad, "device_mesh") and hasattr(grad, "to_local"):
                grad = grad.to_local()
            if grad.is_sparse:
                if grad.dtype is torch.float16:
                    p.grad = grad = grad.coalesce()
                grad = grad._values()
            groups[(grad.device, grad.dtype)].append(grad)
    found_inf = torch.zeros((), dtype=torch.float32, device=device)
    for (dev, _), grads in groups.items():
        local = found_inf if dev == device else torch.zeros((), dtype=torch.float32, device=dev)
        torch._amp_foreach_non_finite_check_and_unscale_(grads, local, inv_scale.to(dev))
        if local is not found_inf:
            found_inf.add_(local.to(device))
    return found_inf


class TorchLossScaler(ScalerCounters, MonitorPort, torch.amp.GradScaler):
    """Dynamic loss scaling driven by :func:`mp_callbacks.loss_scale.next_state`, with ``GradScaler``'s API.

    Args:
      config: the :class:`~mp_callbacks.loss_scale.ScalerConfig`.
      count_overflows: with scaling off and ``skip_nonfinite=False``, whether
        steps count inf/NaN gradients (None: while a monitor is attached).
      divergence: the :class:`~mp_callbacks.diagnostics.DivergenceRule` applied
        to the step decisions (None: the default rule; False: off).
    """

    def __init__(self, config: ScalerConfig, count_overflows: bool | None = None, divergence: Any = None) -> None:
        self.config = config
        self.divergence = TorchDivergence(divergence)
        self.count_overflows = count_overflows
        self._ops = TorchOps("cpu")
        self._state: ScalerState = initial_state(config, self._ops)
        self._grad_scale: Tensor | None = None
        self._stages: dict[int, tuple[OptState, Tensor | None]] = {}
        self._skips: dict[int, bool] = {}  # id(optimizer) -> this step's decision, once read
        self._latest: dict[str, Tensor] = {}
        self._last_applied: dict[int, bool] = {}  # id(optimizer) -> its latest step applied
        self._latest_applied: bool | None = None  # the latest step of any optimizer applied

    # ------------------------------------------------------------ reading
    @property
    def scaler_config(self) -> ScalerConfig:
        """The configuration in use (what :class:`~mp_callbacks.diagnostics.MonitorPort` reads)."""
        return self.config

    @property
    def state(self) -> ScalerState:
        """The current state (0-d device tensors, no sync)."""
        return self._state

    @property
    def grad_scale(self) -> Tensor:
        """The scale the current gradients were produced with (0-d tensor, no sync).

        Differs from the current scale after an earlier optimizer's :meth:`update`
        since the last backward (several optimizers stepping after one backward).
        """
        return self._grad_scale if self._grad_scale is not None else self._state.scale

    def _counter(self, name: str) -> int:
        return int(getattr(self._state, name).item())

    def is_enabled(self) -> bool:
        """True when the loss is scaled."""
        return self.config.enabled

    def get_scale(self) -> float:
        """The current scale as a Python float (one host read; 1.0 with scaling disabled)."""
        return float(self._state.scale.item())

    def get_growth_factor(self) -> float:
        """``growth_factor`` of the configuration."""
        return self.config.growth_factor

    def get_backoff_factor(self) -> float:
        """``backoff_factor`` of the configuration."""
        return self.config.backoff_factor

    def get_growth_interval(self) -> int:
        """``growth_interval`` of the configuration."""
        return self.config.growth_interval

    def set_growth_factor(self, new_factor: float) -> None:
        """Replace ``growth_factor`` (validated by :class:`~mp_callbacks.loss_scale.ScalerConfig`)."""
        self.config = self.config.replace(growth_factor=float(new_factor))

    def set_backoff_factor(self, new_factor: float) -> None:
        """Replace ``backoff_factor`` (validated by :class:`~mp_callbacks.loss_scale.ScalerConfig`)."""
        self.config = self.config.replace(backoff_factor=float(new_factor))

    def set_growth_interval(self, new_interval: int) -> None:
        """Replace ``growth_interval`` (validated by :class:`~mp_callbacks.loss_scale.ScalerConfig`)."""
        self.config = self.config.replace(growth_interval=int(new_interval))

    @property
    def _per_optimizer_states(self) -> dict[int, dict[str, Any]]:
        """torch ``GradScaler``'s per-optimizer record (``{id: {"stage", "found_inf_per_device"}}``), for
        code that reads it; an optimizer not in the cycle is ``READY``."""
        out: dict[int, dict[str, Any]] = defaultdict(lambda: {"stage": OptState.READY, "found_inf_per_device": {}})
        for key, (stage, found) in self._stages.items():
            out[key] = {"stage": stage, "found_inf_per_device": {} if found is None else {found.device: found}}
        return out

    def latest(self) -> dict[str, Tensor]:
        """Device tensors of the latest transition (no sync): ``scale`` (the one its gradients were
        produced with), ``next_scale``, ``overflow``, ``applied``, ``steps``, ``overflows_total``,
        ``skipped_total``, ``growths_total``.  Empty before the first transition."""
        return dict(self._latest)

    def last_step_skipped(self, optimizer: Any | None = None) -> bool:
        """True when the latest step (of ``optimizer``, or of any optimizer) applied no update.

        An optimizer that has not stepped yet answers for the latest step of any optimizer.
        """
        if optimizer is not None and id(unwrap_optimizer(optimizer)) in self._last_applied:
            return not self._last_applied[id(unwrap_optimizer(optimizer))]
        return self._latest_applied is False

    # ---------------------------------------------------------- the cycle
    def to(self, device: torch.device | str) -> TorchLossScaler:
        """Move the state to ``device`` (a no-op when it is there)."""
        device = torch.device(device)
        if self._state.scale.device != device:
            self._ops = TorchOps(device)
            self._state = ScalerState(*(t.to(device) for t in self._state))
        return self

    def scale(self, outputs: Any) -> Any:
        """``outputs * scale`` for a tensor or a (nested) list/tuple of tensors; unchanged when disabled.

        A scalar loss is also kept (detached) for the divergence rule.
        """
        self.divergence.record_loss(outputs)
        if not self.config.enabled:
            return outputs
        if isinstance(outputs, Tensor):
            self.to(outputs.device)
            self._grad_scale = scale = self._state.scale
            return outputs * scale
        if isinstance(outputs, (list, tuple)):
            return type(outputs)(self.scale(o) for o in outputs)
        if isinstance(outputs, Iterable):
            return [self.scale(o) for o in outputs]
        raise TypeError(f"scale() takes a tensor or an iterable of tensors, not {type(outputs).__name__}")

    def unscale_(self, optimizer: Any) -> Tensor:
        """Unscale ``optimizer``'s gradients in place and return ``found_inf`` (see the module's rule).

        Raises ``RuntimeError`` when called twice before :meth:`update` or after :meth:`step`.
        """
        raw = unwrap_optimizer(optimizer)
        stage, _ = self._stages.get(id(raw), _READY)
        if stage is OptState.UNSCALED:
            raise RuntimeError("unscale_() has already been called on this optimizer since the last update().")
        if stage is OptState.STEPPED:
            raise RuntimeError("unscale_() is being called after step().")
        return self.unscale_once(raw)

    def unscale_once(self, optimizer: Any) -> Tensor:
        """:meth:`unscale_`, or the earlier result when ``optimizer`` is unscaled already since the last update."""
        raw = unwrap_optimizer(optimizer)
        stage, found = self._stages.get(id(raw), _READY)
        if found is not None:
            return found
        device = self._state.scale.device
        with torch.no_grad():
            if not self.checks_overflow:  # nothing looked at: no overflow
                found = torch.zeros((), dtype=torch.float32, device=device)
            else:
                inv_scale = (self.grad_scale.double().reciprocal().float() if self.config.enabled
                             else torch.ones((), dtype=torch.float32, device=device))
                found = unscale_and_check(raw, inv_scale, device)
                dist = torch.distributed
                if self.config.can_skip and dist.is_available() and dist.is_initialized() and (
                        dist.get_world_size() > 1):
                    dist.all_reduce(found, op=dist.ReduceOp.MAX)  # every rank takes the same decision
        self._stages[id(raw)] = (OptState.UNSCALED, found)
        return found

    def skips(self, optimizer: Any) -> bool:
        """The step's decision: whether this step of ``optimizer`` is skipped (unscales first when needed).

        The one host read of ``found_inf``, made where the step can be skipped (as ``GradScaler.step``) and kept
        until :meth:`update`; without skipping nothing is read and the answer is False.
        """
        raw = unwrap_optimizer(optimizer)
        key = id(raw)
        skip = self._skips.get(key)
        if skip is None:
            found = self._stages.get(key, _READY)[1]
            if found is None:
                found = self.unscale_once(raw)
            skip = self._skips[key] = self.config.can_skip and bool(found.item())
            self._last_applied[key] = self._latest_applied = not skip
        return skip

    def step(self, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        """``optimizer.step(*args, **kwargs)`` unless the step is skipped (:meth:`skips`; then None)."""
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not supported with loss scaling: step() decides after the backward.")
        raw = unwrap_optimizer(optimizer)
        stage, _ = self._stages.get(id(raw), _READY)
        if stage is OptState.STEPPED:
            raise RuntimeError("step() has already been called since the last update().")
        skip = self.skips(raw)
        self._stages[id(raw)] = (OptState.STEPPED, self._stages[id(raw)][1])
        return None if skip else raw.step(*args, **kwargs)

    def update(self, new_scale: float | Tensor | None = None) -> None:
        """The divergence rule sees the step, then one transition with the flags of every optimizer unscaled
        since the last update.  ``new_scale`` sets the scale directly instead (no transition, as in torch)."""
        flags = [found for _, found in self._stages.values() if found is not None]
        skipped = any(self._skips.values())
        self._stages.clear()
        self._skips.clear()
        if new_scale is not None:
            value = torch.as_tensor(new_scale, dtype=torch.float32, device=self._state.scale.device).reshape(())
            self._state = self._state._replace(scale=value.clone())
            return
        if not flags:
            return
        self.divergence.observe(skipped, self.grad_scale, self._state.steps)
        found = flags[0] if len(flags) == 1 else torch.stack(flags).amax()
        self.record_transition(found > 0)

    def record_transition(self, overflow: Tensor) -> None:
        """Advance the state by one step with device flag ``overflow``; react to a floor hit."""
        old = self._state
        new, applied = next_state(self.config, old, overflow, self._ops)
        self._state = new
        used = self._grad_scale if (self.config.enabled and self._grad_scale is not None) else old.scale
        self._latest = {"scale": used, "next_scale": new.scale, "overflow": overflow, "applied": applied,
                        "steps": new.steps, "overflows_total": new.overflows, "skipped_total": new.skipped,
                        "growths_total": new.growths}
        if self.config.enabled and self.config.on_min_scale != "clamp" and self._latest_applied is False:
            if int(new.floor_hits.item()) > int(old.floor_hits.item()):
                react_to_floor_hit(self.config, int(new.steps.item()), float(new.scale.item()), stacklevel=5)

    def forget_step(self, optimizer: Any) -> None:
        """An optimizer step that ran no backward (``training_step`` returned None): no transition."""
        key = id(unwrap_optimizer(optimizer))
        self._stages.pop(key, None)
        self._skips.pop(key, None)
        self._last_applied[key] = self._latest_applied = False

    # -------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The versioned plain-data record (config, state, counters; one host read)."""
        return make_state_dict(self.config, self._state)

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore a :meth:`state_dict`; another config or a corrupt record is a ``StateDictError``."""
        device = self._state.scale.device
        self._state = state_from_dict(check_state_dict(self.config, state_dict), TorchOps(device))

    def __getstate__(self) -> dict[str, Any]:  # GradScaler's own would read attributes it never got
        return self.__dict__.copy()

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def __repr__(self) -> str:
        return f"TorchLossScaler(config={self.config!r})"
