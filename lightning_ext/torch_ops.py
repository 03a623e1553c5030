"""The scaler's array-ops vocabulary over 0-d torch tensors on one device.

:class:`TorchOps` lets :func:`mp_callbacks.scaler.next_state` run on the
training device: every value is a 0-d tensor (float32 scale, int32 trackers and
counters, boolean predicates) and no method reads a value back to the host, so
one scaler transition costs a handful of tiny kernels and no synchronisation.
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

    def __repr__(self) -> str:
        return f"TorchOps(device={str(self.device)!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TorchOps) and other.device == self.device

    def __hash__(self) -> int:
        return hash(("TorchOps", str(self.device)))

    # -- constants and conversions ------------------------------------------------
    def _scalar(self, value: Any, dtype: torch.dtype) -> torch.Tensor:
        if isinstance(value, torch.Tensor):
            return value.to(device=self.device, dtype=dtype).reshape(())
        return torch.full((), value, dtype=dtype, device=self.device)

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
        """``a`` where ``cond`` else ``b``, in ``a``'s dtype."""
        a = torch.as_tensor(a, device=self.device)
        b = torch.as_tensor(b, device=self.device).to(a.dtype)
        return torch.where(self.boolean(cond), a, b)

    def mul(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """``a * b`` in ``a``'s dtype (float32 overflow gives inf, as in NumPy)."""
        return torch.mul(a, torch.as_tensor(b, device=self.device).to(a.dtype))

    def add(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """``a + b`` in ``a``'s dtype."""
        return torch.add(a, torch.as_tensor(b, device=self.device).to(a.dtype))

    def minimum(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """Elementwise minimum."""
        return torch.minimum(a, torch.as_tensor(b, device=self.device).to(a.dtype))

    def maximum(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """Elementwise maximum."""
        return torch.maximum(a, torch.as_tensor(b, device=self.device).to(a.dtype))

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
