"""Functions of a module answered by ours while some thread's step needs it, torch's for every other call.

The native passes (:mod:`lightning_ext.master_native`, :mod:`lightning_ext.adam_native`) take over a
function torch's optimizer calls (``torch._fused_adamw_``, ``torch.optim.adam._single_tensor_adam``) for
the duration of one ``optimizer.step()``.  The attribute is module-wide, the step is one thread's: the rule
is that the replacement is installed by the first thread to enter, restored by the last to leave, and that
each thread sees its own :attr:`ThreadSwap.local` state (None outside a step), so a call from another
thread goes to torch's function (:meth:`ThreadSwap.original`).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["ThreadSwap"]


class ThreadSwap:
    """``owner``'s attributes ``replacements`` installed while any thread is inside :meth:`active`."""

    def __init__(self, owner: Any, replacements: dict[str, Callable[..., Any]]) -> None:
        self.owner, self.replacements = owner, replacements
        self.local = threading.local()
        """``.state``: the value this thread's :meth:`active` was given (absent or None outside)."""
        self._originals: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._depth = 0

    def original(self, name: str) -> Any:
        """The function the replacement of ``name`` stands in for."""
        return self._originals.get(name) or getattr(self.owner, name)

    def state(self) -> Any:
        """This thread's state (None outside :meth:`active`)."""
        return getattr(self.local, "state", None)

    @contextlib.contextmanager
    def active(self, state: Any) -> Iterator[None]:
        """The replacements installed (by the first thread in) and this thread's ``state`` set, until exit."""
        with self._lock:
            if not self._depth:
                for name, fn in self.replacements.items():
                    self._originals[name] = getattr(self.owner, name)
                    setattr(self.owner, name, fn)
            self._depth += 1
        self.local.state = state
        try:
            yield
        finally:
            self.local.state = None
            with self._lock:
                self._depth -= 1
                if not self._depth:
                    for name, fn in self._originals.items():
                        setattr(self.owner, name, fn)
                    self._originals.clear()
