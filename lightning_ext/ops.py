"""The scaler's array-ops vocabulary over 0-d torch tensors on one device.

:class:`TorchOps` lets :func:`mp_callbacks.loss_scale.next_state` run on the
training device: every value is a 0-d tensor (float32 scale, int32 trackers and
counters, boolean predicates) and no method reads a value back to the host, so
one scaler transition costs a handful of tiny kernels and no synchronisation.

It also provides the five vector ops of :class:`mp_callbacks.fp8.FP8ArrayOps`
(``divide``, ``reduce_max``, ``roll_left``, ``set_first``, ``zeros``), so the
FP8 scaling transition (:func:`mp_callbacks.fp8.next_fp8_state`) runs on the
device too, for one tensor's state or for a batch of them (leading axes on
every field; a condition with fewer axes selects along the leading ones).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["TorchOps"]


class TorchOps:
    """:class:`mp_callbacks.ops.ArrayOps` implemented with 0-d torch tensors on ``device``.

    >>> ops = TorchOps("cpu")
    >>> ops.where(ops.boolean(True), ops.f32(2.0), ops.f32(3.0))
    tensor(2.)
    """

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        # Python constants (growth_interval, factors, 0, 1...) become device tensors once:
        # a scaler transition then launches only its arithmetic.  Never mutated in place.
        self._constants: dict[tuple[torch.dtype, type, str], torch.Tensor] = {}

    def __repr__(self) -> str:
        return f"TorchOps(device={str(self.device)!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TorchOps) and other.device == self.device

    def __hash__(self) -> int:
        return hash(("TorchOps", str(self.device)))

    # -- constants and conversions ------------------------------------------------
    def _scalar(self, value: Any, dtype: torch.dtype) -> torch.Tensor:
        if isinstance(value, torch.Tensor):
            if value.dtype == dtype and value.dim() == 0 and value.device == self.device:
                return value
            value = value.to(device=self.device, dtype=dtype)
            return value.reshape(()) if value.numel() == 1 else value  # a batch (FP8 states) keeps its shape
        key = (dtype, type(value), repr(value))  # repr keeps -0.0 apart from 0.0
        constant = self._constants.get(key)
        if constant is None:
            constant = self._constants[key] = torch.full((), value, dtype=dtype, device=self.device)
        return constant

    def _like(self, b: Any, a: torch.Tensor) -> torch.Tensor:
        """``b`` as a tensor of ``a``'s dtype on this device (constants cached)."""
        if isinstance(b, torch.Tensor) and b.dtype == a.dtype and b.device == self.device:
            return b
        return self._scalar(b, a.dtype)

    def f32(self, value: Any) -> torch.Tensor:
        """A float32 0-d tensor holding ``value`` (a number or a tensor)."""
        return self._scalar(value, torch.float32)

    def i32(self, value: Any) -> torch.Tensor:
        """An int32 0-d tensor holding ``value`` (a number, a bool or a tensor)."""
        if isinstance(value, bool):
            value = int(value)
        return self._scalar(value, torch.int32)

    def boolean(self, value: Any) -> torch.Tensor:
        """A boolean 0-d tensor holding ``value``."""
        return self._scalar(value, torch.bool)

    # -- arithmetic and selection ---------------------------------------------------
    def where(self, cond: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """``a`` where ``cond`` else ``b``, in ``a``'s dtype.

        A condition with fewer axes than ``a`` (batched FP8 states) selects along ``a``'s leading axes.
        """
        if not isinstance(a, torch.Tensor):
            a = torch.as_tensor(a, device=self.device)
        if isinstance(cond, torch.Tensor) and 0 < cond.dim():
            cond = cond.to(device=self.device, dtype=torch.bool)
            if cond.dim() < a.dim():
                cond = cond.reshape(cond.shape + (1,) * (a.dim() - cond.dim()))
            return torch.where(cond, a, self._like(b, a))
        return torch.where(self.boolean(cond), a, self._like(b, a))

    def mul(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """``a * b`` in ``a``'s dtype (float32 overflow gives inf, as in NumPy)."""
        return torch.mul(a, self._like(b, a))

    def add(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """``a + b`` in ``a``'s dtype."""
        return torch.add(a, self._like(b, a))

    def minimum(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """Elementwise minimum."""
        return torch.minimum(a, self._like(b, a))

    def maximum(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """Elementwise maximum."""
        return torch.maximum(a, self._like(b, a))

    def isfinite(self, a: torch.Tensor) -> torch.Tensor:
        """True where ``a`` is neither inf nor NaN."""
        return torch.isfinite(a)

    # -- logic and comparisons ------------------------------------------------------
    def logical_and(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """Boolean and."""
        return torch.logical_and(a, b)

    def logical_or(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """Boolean or."""
        return torch.logical_or(a, b)

    def logical_not(self, a: torch.Tensor) -> torch.Tensor:
        """Boolean not."""
        return torch.logical_not(a)

    def greater_equal(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """``a >= b``."""
        return torch.greater_equal(a, b)

    def less_equal(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """``a <= b``."""
        return torch.less_equal(a, b)

    def not_equal(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """``a != b``."""
        return torch.not_equal(a, b)

    # -- the FP8 vector ops (mp_callbacks.fp8.FP8ArrayOps) -----------------------------
    def divide(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """``a / b`` in ``a``'s dtype (IEEE: ``x / 0`` is inf, ``0 / 0`` NaN, overflow inf)."""
        return torch.div(a, self._like(b, a))

    def reduce_max(self, v: torch.Tensor) -> torch.Tensor:
        """The largest element along the last axis."""
        return torch.amax(v, dim=-1)

    def roll_left(self, v: torch.Tensor) -> torch.Tensor:
        """``[v1, ..., v(n-1), v0]`` along the last axis."""
        return torch.roll(v, -1, dims=-1)

    def set_first(self, v: torch.Tensor, value: Any) -> torch.Tensor:
        """A new tensor: ``v`` with element 0 of its last axis replaced by ``value`` (no in-place write)."""
        first = self._like(value, v)
        first = first.expand(v.shape[:-1]).unsqueeze(-1) if first.dim() == 0 else first.reshape(
            v.shape[:-1] + (1,))
        return torch.cat([first, v[..., 1:]], dim=-1)

    def zeros(self, length: int) -> torch.Tensor:
        """A float32 vector of ``length`` zeros on this device."""
        return torch.zeros(int(length), dtype=torch.float32, device=self.device)
