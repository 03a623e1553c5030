"""``ScalerStateMirror``: where :class:`~lightning_ext.scaler.TorchLossScaler`'s state lives between steps.

The state is a :class:`~mp_callbacks.loss_scale.transition.ScalerState` of 0-d device tensors.  With scaling
off and every step's decision already read on the host, the transition needs no device op: it runs on the
host in Python scalars (:data:`~mp_callbacks.ops.PYTHON_OPS`, NumPy's float32/int32 numbers) and the host
state runs ahead of the device.  Rules:

* :attr:`~ScalerStateMirror.device` is the device state; reading it while the host is ahead makes it from the
  host state first (one small copy per field), after which the two agree again;
* :meth:`~ScalerStateMirror.host_transition` starts from the host state, or from the device state read once
  (one host read per field);
* assigning :attr:`~ScalerStateMirror.device` drops the host state (the device is the truth again);
* :meth:`~ScalerStateMirror.take_host_latest` hands the latest host transition's figures over once, as device
  tensors, in the shape of :meth:`TorchLossScaler.latest`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from mp_callbacks.loss_scale.config import ScalerConfig
from mp_callbacks.loss_scale.transition import ScalerState, next_state
from mp_callbacks.ops import PYTHON_OPS

__all__ = ["ScalerStateMirror"]


class ScalerStateMirror:
    """The scaler state on the device, or ahead of it on the host (scaling off, decisions read already)."""

    def __init__(self, state: ScalerState) -> None:
        self._device_state = state
        self._host: ScalerState | None = None  # ahead of the device state while _stale
        self._stale = False
        self._host_latest: tuple[ScalerState, bool, bool] | None = None  # (old, overflow, applied)

    @property
    def on_device(self) -> torch.device:
        """The device the state lives on (no copy)."""
        return self._device_state.scale.device

    @property
    def device(self) -> ScalerState:
        """The device state, made from the host state on first read after host transitions."""
        if self._stale:
            host, device = self._host, self.on_device
            self._device_state = ScalerState(torch.tensor(host.scale, dtype=torch.float32, device=device),
                                             *(torch.tensor(v, dtype=torch.int32, device=device) for v in host[1:]))
            self._stale = False
        return self._device_state

    @device.setter
    def device(self, value: ScalerState) -> None:
        self._device_state, self._host, self._stale, self._host_latest = value, None, False, None

    def counter(self, name: str) -> int:
        """One state field as a Python int (from the host state when it is ahead, else one device read)."""
        if self._stale:
            return int(getattr(self._host, name))
        return int(getattr(self.device, name).item())

    def host_transition(self, config: ScalerConfig, overflow: bool) -> None:
        """:func:`~mp_callbacks.loss_scale.transition.next_state` on the host: no op is launched."""
        old = self._host
        if old is None:
            state = self.device
            old = ScalerState(PYTHON_OPS.f32(state.scale.item()), *(PYTHON_OPS.i32(v.item()) for v in state[1:]))
        new, applied = next_state(config, old, overflow, PYTHON_OPS)
        self._host, self._stale, self._host_latest = new, True, (old, overflow, bool(applied))

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
