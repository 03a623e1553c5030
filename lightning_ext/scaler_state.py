"""``ScalerStateMirror``: where :class:`~lightning_ext.scaler.TorchLossScaler`'s state lives between steps.

The state is a :class:`~mp_callbacks.loss_scale.transition.ScalerState` of 0-d device tensors.  When every
step's decision is already read on the host (the step's one read of ``found_inf``: always when the step can be
skipped), the transition needs no device op: it runs on the host in Python scalars
(:data:`~mp_callbacks.ops.PYTHON_OPS`, NumPy's float32/int32 numbers) and the host state runs ahead of the
device.  Rules:

* :attr:`~ScalerStateMirror.device` is the device state; reading it while the host is ahead makes it from the
  host state first (one small copy per field), after which the two agree again;
* :meth:`~ScalerStateMirror.host_transition` starts from the host state, or from the device state read once
  (one host read per field);
* assigning :attr:`~ScalerStateMirror.device` drops the host state (the device is the truth again);
* :meth:`~ScalerStateMirror.scale_tensor` is the scale the next backward runs with, as a 0-d float32 device
  tensor: the device state's while the host is not ahead, else one made from the host scale (kept while the
  scale stays the same, so a step makes none), with its float32 inverse (:meth:`~ScalerStateMirror.inverse`);
* :meth:`~ScalerStateMirror.take_host_latest` hands the latest host transition's figures over once, as device
  tensors, in the shape of :meth:`TorchLossScaler.latest`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from mp_callbacks.loss_scale import ScalerConfig, ScalerState, next_state
from mp_callbacks.ops import PYTHON_OPS

__all__ = ["ScalerStateMirror"]


class ScalerStateMirror:
    """The scaler state on the device, or ahead of it on the host (every decision read there already)."""

    def __init__(self, state: ScalerState) -> None:
        self._device_state = state
        self._host: ScalerState | None = None  # ahead of the device state while _stale
        self._stale = False
        self._host_latest: tuple[ScalerState, bool, bool] | None = None  # (old, overflow, applied)
        self._scale_cache: tuple[float, Tensor, Tensor] | None = None  # (host scale, its tensor, its inverse)

    @property
    def on_device(self) -> torch.device:
        """The device the state lives on (no copy)."""
        return self._device_state.scale.device

    @property
    def device(self) -> ScalerState:
        """The device state, made from the host state on first read after host transitions."""
        if self._stale:
            host, device, cache = self._host, self.on_device, self._scale_cache
            scale = (cache[1] if cache is not None and cache[0] == host.scale and cache[1].device == device
                     else torch.tensor(host.scale, dtype=torch.float32, device=device))
            self._device_state = ScalerState(scale, *(torch.tensor(v, dtype=torch.int32, device=device)
                                                      for v in host[1:]))
            self._stale = False
        return self._device_state

    @device.setter
    def device(self, value: ScalerState) -> None:
        self._device_state, self._host, self._stale, self._host_latest = value, None, False, None

    @property
    def host(self) -> ScalerState | None:
        """The state in Python scalars, ahead of the device's or equal to it; None while only the device has it."""
        return self._host

    def scale_tensor(self) -> Tensor:
        """The current scale as a 0-d float32 device tensor, made from the host scale (once per value) when the
        host is ahead, so that a step whose state lives on the host launches no op for it."""
        if not self._stale:
            return self._device_state.scale
        value = self._host.scale
        cache = self._scale_cache
        if cache is None or cache[0] != value or cache[1].device != self.on_device:
            device = self.on_device
            # GradScaler's inverse: the reciprocal in float64, rounded to float32
            cache = self._scale_cache = (value, torch.tensor(value, dtype=torch.float32, device=device),
                                         torch.tensor(1.0 / value, dtype=torch.float32, device=device))
        return cache[1]

    def inverse(self, scale: Tensor) -> Tensor:
        """``1 / scale`` as GradScaler computes it (float64 reciprocal, rounded to float32); no op for a tensor
        that :meth:`scale_tensor` made."""
        cache = self._scale_cache
        if cache is not None and cache[1] is scale:
            return cache[2]
        return scale.double().reciprocal().float()

    def host_value(self, scale: Tensor) -> float | None:
        """The host value of a tensor that :meth:`scale_tensor` made while the host was ahead, else None."""
        cache = self._scale_cache
        return cache[0] if cache is not None and cache[1] is scale else None

    def counter(self, name: str) -> int:
        """One state field as a Python int (from the host state when there is one, else one device read)."""
        if self._host is not None:
            return int(getattr(self._host, name))
        return int(getattr(self.device, name).item())

    def host_transition(self, config: ScalerConfig, overflow: bool,
                        used_scale: float | None = None) -> tuple[ScalerState, ScalerState]:
        """:func:`~mp_callbacks.loss_scale.transition.next_state` on the host: no op is launched.  Returns
        ``(old, new)`` host states; ``used_scale``: the scale the step's gradients were made with, for
        :meth:`take_host_latest` (default: the old state's)."""
        old = self._host  # equal to the device state when not ahead (dropped when the device is assigned)
        if old is None:
            state = self.device
            old = ScalerState(PYTHON_OPS.f32(state.scale.item()), *(PYTHON_OPS.i32(v.item()) for v in state[1:]))
        new, applied = next_state(config, old, overflow, PYTHON_OPS)
        used = old if used_scale is None or used_scale == old.scale else old._replace(scale=used_scale)
        self._host, self._stale, self._host_latest = new, True, (used, overflow, bool(applied))
        return old, new

    def take_host_latest(self) -> dict[str, Tensor] | None:
        """The latest host transition's figures as device tensors (once; None when there is none since)."""
        if self._host_latest is None:
            return None
        old, overflow, applied = self._host_latest
        self._host_latest = None
        state = self.device
        device = state.scale.device
        return {"scale": torch.tensor(old.scale, dtype=torch.float32, device=device), "next_scale": state.scale,
                "overflow": torch.tensor(overflow, device=device), "applied": torch.tensor(applied, device=device),
                "steps": state.steps, "overflows_total": state.overflows, "skipped_total": state.skipped,
                "growths_total": state.growths}
