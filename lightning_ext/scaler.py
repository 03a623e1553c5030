"""``TorchLossScaler``: the core's loss scaler with torch ``GradScaler``'s public API.

What ``trainer.scaler`` returns for recipes that scale the loss.  The state
(:class:`~mp_callbacks.loss_scale.scaler.ScalerState`) lives in 0-d tensors on the
training device and moves only by :func:`mp_callbacks.loss_scale.scaler.next_state`
evaluated with :class:`~lightning_ext.ops.TorchOps`.  The protocol is
``GradScaler``'s::

    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)        # optional: before clipping or reading grads
    scaler.step(optimizer)            # skipped when the gradients are not finite
    scaler.update()                   # one scaler transition

Per optimizer, a stage guards the order (``READY`` -> ``UNSCALED`` ->
``STEPPED``, back to ``READY`` at :meth:`update`): unscaling twice or after the
step is an error, as in torch.  Rules:

* ``unscale_``: the plugin's weight store takes the gradients first (under
  ``*-master`` they move onto the FP32 masters: :class:`~lightning_ext.masters.MasterWeights`;
  :func:`~lightning_ext.rounding.weight_store`); then, when the step
  checks for overflows (:attr:`checks_overflow`, the core's
  :func:`~mp_callbacks.loss_scale.scaler.checks_overflow`), torch's fused
  ``_amp_foreach_non_finite_check_and_unscale_`` unscales by ``1/scale``
  (computed in float64, as ``GradScaler``) and sets ``found_inf`` (scaling off:
  a read-only scan where it applies, nothing written), which is
  all-reduced (MAX) over the process group so every rank decides alike
  (under FSDP2 each rank checks its local gradient shards: ``ShardedGradScaler``'s
  semantics): :func:`~lightning_ext.grad_check.non_finite_check`.
* ``step``: one host read of ``found_inf`` where the step can be skipped (as
  ``GradScaler.step``; :meth:`TorchLossScaler.skips` may read it earlier, once), none
  where the check decided on the host (scaling off on the CPU:
  :func:`~lightning_ext.grad_check.host_check`; a write to the flag since, as FP8's
  amax check makes, is read); a
  skipped step calls nothing, so parameters, masters, compensation buffers, the
  rounding stream, optimizer state and the optimizer's step counters stay as they
  were; an applied one goes through the weight store.  The divergence rule sees the
  decision (:class:`~lightning_ext.divergence.TorchDivergence`).
* ``update``: the transition with the flags of the optimizers stepped since
  the last update; a floor hit reacts per ``on_min_scale``
  (:func:`~mp_callbacks.loss_scale.scaler.react_to_floor_hit`).  With every
  decision already read on the host (whenever a step can be skipped: loss scaling
  on, or ``skip_nonfinite``, the default; and when nothing was checked: no overflow), the same
  :func:`~mp_callbacks.loss_scale.transition.next_state` runs on the host instead of
  launching its ops (:class:`~lightning_ext.scaler_state.ScalerStateMirror`): the
  state then lives on the host until something reads it (:attr:`TorchLossScaler.state`,
  :meth:`TorchLossScaler.latest`), which puts it back on the device; the next
  backward's scale (and its inverse) is a device tensor made once per scale value.

With scaling disabled (bf16 and FP32 recipes) the same object counts
overflows for the monitor; the plugin then exposes it as ``loss_scaler`` only
and ``plugin.scaler`` is None, as in Lightning.  It is a ``torch.amp.GradScaler``
for ``isinstance`` checks (Lightning's, users'), not built on one: no
``GradScaler`` method runs unless this class defines it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

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

from .adam_native import single_tensor_pass
from .divergence import TorchDivergence
from .grad_check import Flags, UnitScales, host_check, non_finite_check
from .ops import TorchOps
from .scaler_compat import GradScalerSettings, OptState
from .scaler_state import ScalerStateMirror

__all__ = ["TorchLossScaler", "scaler_config_from", "unwrap_optimizer"]

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


class TorchLossScaler(GradScalerSettings, ScalerCounters, MonitorPort, torch.amp.GradScaler):
    """Dynamic loss scaling driven by :func:`mp_callbacks.loss_scale.scaler.next_state`, with ``GradScaler``'s API.

    Args:
      config: the :class:`~mp_callbacks.loss_scale.config.ScalerConfig`.
      store: the plugin's weight store (:func:`~lightning_ext.rounding.weight_store`: FP32 masters
        under ``*-master``, update rounding under ``bf16-kahan``/``bf16-sr``), or None.
      count_overflows: with scaling off and ``skip_nonfinite=False``, whether
        steps count inf/NaN gradients (None: while a monitor is attached).
      divergence: the :class:`~mp_callbacks.diagnostics.divergence.DivergenceRule` applied
        on skipped steps (None: the default rule; False: off).
    """

    def __init__(self, config: ScalerConfig, store: Any = None, count_overflows: bool | None = None,
                 divergence: Any = None) -> None:
        self.config = config
        self.store = store
        self.divergence = TorchDivergence(divergence)
        self.count_overflows = count_overflows
        self._ops = TorchOps("cpu")
        self._mirror = ScalerStateMirror(initial_state(config, self._ops))
        self._grad_scale: Tensor | None = None
        self._stages: dict[int, tuple[OptState, Tensor | None]] = {}
        self._skips: dict[int, bool] = {}  # id(optimizer) -> this step's decision, once read
        self._decided: dict[int, bool] = {}  # id(optimizer) -> its overflow flag, where the host knows it
        self._latest: dict[str, Tensor] = {}
        self._last_applied: dict[int, bool] = {}  # id(optimizer) -> its latest step applied
        self._latest_applied: bool | None = None  # the latest step of any optimizer applied
        self._units = UnitScales()  # the unit inverse scale per device (scaling off)
        self._flags = Flags()  # found_inf 0 and 1 per device, for decisions made on the host
        self._host_flags: dict[int, tuple[Tensor, int, bool]] = {}  # id(optimizer) -> (flag, its version, overflow)

    # ------------------------------------------------------------ state
    @property
    def _state(self) -> ScalerState:
        """The device state (:class:`~lightning_ext.scaler_state.ScalerStateMirror`)."""
        return self._mirror.device

    @_state.setter
    def _state(self, value: ScalerState) -> None:
        self._mirror.device = value

    # ------------------------------------------------------------ reading
    @property
    def scaler_config(self) -> ScalerConfig:
        """The configuration in use (what :class:`~mp_callbacks.diagnostics.monitor.MonitorPort` reads)."""
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
        return self._grad_scale if self._grad_scale is not None else self._mirror.scale_tensor()

    def _counter(self, name: str) -> int:
        return self._mirror.counter(name)

    def latest(self) -> dict[str, Tensor]:
        """Device tensors of the latest transition (no sync): ``scale`` (the one its gradients were
        produced with), ``next_scale``, ``overflow``, ``applied``, ``steps``, ``overflows_total``,
        ``skipped_total``, ``growths_total``.  Empty before the first transition."""
        host_latest = self._mirror.take_host_latest()  # a host transition: its figures go to the device now
        if host_latest is not None:
            self._latest = host_latest
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
        if self._mirror.on_device != device:
            self._ops = TorchOps(device)
            self._state = ScalerState(*(t.to(device) for t in self._state))
        return self

    def scale(self, outputs: Any) -> Any:
        """``outputs * scale`` for a tensor or a (nested) list/tuple of tensors; unchanged when disabled.

        A scalar loss is also remembered as finite or not (a device flag) for the divergence rule.
        """
        self.divergence.record_loss(outputs)
        if not self.config.enabled:
            return outputs
        if isinstance(outputs, Tensor):
            self.to(outputs.device)
            self._grad_scale = scale = self._mirror.scale_tensor()
            return outputs * scale
        if isinstance(outputs, (list, tuple)):
            return type(outputs)(self.scale(o) for o in outputs)
        if isinstance(outputs, Iterable):
            return [self.scale(o) for o in outputs]
        raise TypeError(f"scale() takes a tensor or an iterable of tensors, not {type(outputs).__name__}")

    def unscale_(self, optimizer: Any) -> Tensor:
        """Unscale ``optimizer``'s gradients in place (FP32 masters first) and return ``found_inf``.

        Raises ``RuntimeError`` when called twice before :meth:`update` or after :meth:`step`.
        """
        raw = unwrap_optimizer(optimizer)
        stage, _ = self._stages.get(id(raw), (OptState.READY, None))
        if stage is OptState.UNSCALED:
            raise RuntimeError("unscale_() has already been called on this optimizer since the last update().")
        if stage is OptState.STEPPED:
            raise RuntimeError("unscale_() is being called after step().")
        return self.unscale_once(raw)

    def unscale_once(self, optimizer: Any, one_pass: bool = False) -> Tensor:
        """:meth:`unscale_`, or the earlier result when this optimizer is unscaled already (the plugin's path).
        ``one_pass``: nothing reads the gradients before the step (:meth:`MasterWeights.collect_grads`)."""
        raw = unwrap_optimizer(optimizer)
        key = id(raw)
        stage, found = self._stages.get(key, _READY)
        if stage is OptState.UNSCALED and found is not None:
            return found
        config, device = self.config, self._mirror.on_device
        grad_mode = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)  # torch.no_grad() without its context object (once per step)
        try:
            if self.store is not None:
                self.store.collect_grads(raw, one_pass=one_pass and not config.enabled)
            if config.can_skip or self.checks_overflow:
                found = self._check_and_unscale(raw, device)
            else:  # nothing looked at: no overflow, known on the host (the transition runs there)
                found = self._flags.of(False, device)
                self._decided[key] = False
        finally:
            torch._C._set_grad_enabled(grad_mode)
        self._stages[key] = (OptState.UNSCALED, found)
        return found

    def step(self, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        """``optimizer.step(*args, **kwargs)`` unless the gradients are not finite (then None)."""
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not supported with loss scaling: step() decides after the backward.")
        raw = unwrap_optimizer(optimizer)
        key = id(raw)
        if self._stages.get(key, _READY)[0] is OptState.STEPPED:
            raise RuntimeError("step() has already been called since the last update().")
        skip = self._skips.pop(key, None)  # read already (:meth:`skips`)
        if skip is None:
            skip = self._read_skip(raw, key)  # the one host read of the step (none when decided on the host)
            del self._skips[key]
        self._stages[key] = (OptState.STEPPED, self._stages[key][1])
        if self.config.can_skip:
            self._decided[key] = skip
        self._last_applied[key] = self._latest_applied = not skip
        if skip:
            self.divergence.observe(True, self.grad_scale, self._state.steps)
            return None
        self.divergence.applied()
        if self.store is not None:
            return self.store.step(raw, *args, **kwargs)
        with single_tensor_pass(raw):  # torch's default CPU Adam/AdamW in one native pass, the same bits
            return raw.step(*args, **kwargs)

    def skips(self, optimizer: Any) -> bool:
        """Whether this step of ``optimizer`` will be skipped (unscales first when needed): the step's one
        host read of ``found_inf``, cached for :meth:`step` (Fabric's clipping asks before the step)."""
        raw = unwrap_optimizer(optimizer)
        key = id(raw)
        skip = self._skips.get(key)
        return self._read_skip(raw, key) if skip is None else skip

    def _read_skip(self, raw: Any, key: int) -> bool:
        """:meth:`skips` when not read yet: unscale (when not done), then the check's host decision if nothing
        wrote to its flag since (FP8's amax check ORs into it), else one read of ``found_inf``."""
        stage, found = self._stages.get(key, _READY)
        if stage is OptState.READY or found is None:
            found = self.unscale_once(raw)
        host = self._host_flags.pop(key, None)
        can_skip = self.config.can_skip
        if host is not None and host[0] is found and found._version == host[1]:
            self._decided[key] = host[2]
            skip = can_skip and host[2]
        else:
            skip = can_skip and bool(found.item())
        self._skips[key] = skip
        return skip

    def update(self, new_scale: float | Tensor | None = None) -> None:
        """One scaler transition with the flags of the optimizers stepped since the last update.

        ``new_scale`` sets the scale directly instead (no transition, as in torch).
        """
        stages = self._stages
        stepped_ids = [key for key, (stage, _) in stages.items() if stage is OptState.STEPPED]
        stepped = [stages[key][1] for key in stepped_ids]
        flags = [self._decided.get(key) for key in stepped_ids]
        self._decided = {}
        stages.clear()
        self._skips.clear()
        self._host_flags.clear()
        if new_scale is not None:
            value = torch.as_tensor(new_scale, dtype=torch.float32, device=self._state.scale.device).reshape(())
            self._state = self._state._replace(scale=value.clone())
            return
        if not stepped:
            return
        if None not in flags:  # every decision on the host: so is the transition
            produced = self._grad_scale  # the scale the gradients were made with, when not the current one
            current = produced is None or not self.config.enabled or produced is self._mirror.scale_tensor()
            used = None if current else self._mirror.host_value(produced)
            if current or used is not None:
                self._host_transition(any(flags), used)
                return
        found = stepped[0] if len(stepped) == 1 else torch.stack(stepped).amax()
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
        if self._floor_hit_reacts() and int(new.floor_hits.item()) > int(old.floor_hits.item()):
            react_to_floor_hit(self.config, int(new.steps.item()), float(new.scale.item()), stacklevel=5)

    def _host_transition(self, overflow: bool, used_scale: float | None) -> None:
        """:meth:`record_transition` on the host (:class:`~lightning_ext.scaler_state.ScalerStateMirror`)."""
        old, new = self._mirror.host_transition(self.config, overflow, used_scale if self.config.enabled else None)
        if self._floor_hit_reacts() and int(new.floor_hits) > int(old.floor_hits):
            react_to_floor_hit(self.config, int(new.steps), float(new.scale), stacklevel=5)

    def _floor_hit_reacts(self) -> bool:
        """Whether a transition that hit the scale floor warns or raises (the floor counts are read only then):
        scaling on, ``on_min_scale`` not ``"clamp"``, and the latest step skipped."""
        return self.config.enabled and self.config.on_min_scale != "clamp" and self._latest_applied is False

    def forget_step(self, optimizer: Any) -> None:
        """An optimizer step that ran no backward (``training_step`` returned None): no transition."""
        raw = unwrap_optimizer(optimizer)
        self._stages.pop(id(raw), None)
        self._skips.pop(id(raw), None)
        self._decided.pop(id(raw), None)
        self._host_flags.pop(id(raw), None)
        self._last_applied[id(raw)] = self._latest_applied = False

    def _check_and_unscale(self, optimizer: Optimizer, device: torch.device) -> Tensor:
        """:func:`~lightning_ext.grad_check.non_finite_check` with this step's inverse scale; with scaling off,
        where :func:`~lightning_ext.grad_check.host_check` decides, the decision is kept on the host (the step
        reads no flag unless something writes to it first; the transition runs there), the flag a cached constant."""
        config = self.config
        if config.enabled:
            return non_finite_check(optimizer, device, self._mirror.inverse(self.grad_scale), self._units, True)
        overflow = host_check(optimizer, device, config.can_skip)
        if overflow is None:
            return non_finite_check(optimizer, device, None, self._units, config.can_skip)
        found = self._flags.of(overflow, device)
        self._host_flags[id(optimizer)] = (found, found._version, overflow)
        return found

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
