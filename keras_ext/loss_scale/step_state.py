"""The variables a train step writes besides the optimizer's saved state (the divergence streaks, a monitor's
device record), and how the step carries them on JAX.

Keras' JAX trainer applies the optimizer statelessly: inside the jitted train step it calls
``optimizer.stateless_apply(optimizer_variables, grads, trainable_variables)`` and keeps what comes back; only
variables listed in ``optimizer.variables`` carry state from one step to the next.  So on JAX the optimizer lists
its :class:`StepState` after its own variables, and leaves it out while it saves or loads (never saved); on the
other backends the variables are written in place and the list is empty.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

from ..ops import is_jax

__all__ = ["StepState"]


class StepState:
    """Variables a train step writes besides the optimizer's saved state, in groups by owner.

    A group registered later comes later, so removing the newest group (the monitor's, at detach) never moves
    another variable's position.
    """

    def __init__(self) -> None:
        self._groups: dict[str, list[Any]] = {}
        self._hidden = False

    def register(self, owner: str, variables: Sequence[Any]) -> None:
        """Add (or replace, at the end) ``owner``'s group."""
        self._groups.pop(owner, None)
        self._groups[owner] = list(variables)

    def remove(self, owner: str) -> None:
        """Drop ``owner``'s group (no error when absent)."""
        self._groups.pop(owner, None)

    @property
    def variables(self) -> list[Any]:
        """The registered variables, oldest group first (JAX only; empty while :meth:`hidden`)."""
        if self._hidden or not is_jax():
            return []
        return [v for group in self._groups.values() for v in group]

    @contextlib.contextmanager
    def hidden(self) -> Iterator[None]:
        """Leave the groups out of :attr:`variables` (while the optimizer saves or loads its own)."""
        self._hidden, before = True, self._hidden
        try:
            yield
        finally:
            self._hidden = before
