"""What both frameworks' ``MixedPrecisionMonitor`` callbacks decide, written once.

An adapter's callback gathers numbers from its framework (scale, overflow
flag, counters, optional meters, the blamed module) and hands them to
:class:`MonitorCore`, which

* decides when to log (every ``log_every_n_steps`` applied or skipped steps,
  and on every overflow step);
* builds the :class:`~mp_callbacks.diagnostics.StepStats` and the metric dict
  with the shared names, and keeps the :class:`History`;
* records overflow attributions as history events;
* runs the divergence guard (optional) and the auto-fallback tracker
  (optional), returning the modules to move to FP32.

Host syncs: the adapters read device values only on logging steps and on
overflow steps (which the scaler already knows about on the host).
"""

from __future__ import annotations

from typing import Any, Mapping

from .diagnostics import History, StepStats
from .meters import DivergenceGuard, FallbackTracker

MONITOR_SCHEMA_VERSION = 1


class MonitorCore:
    """Logging cadence, history, divergence guard and auto-fallback for one run.

    Args:
      log_every_n_steps: log a full record every N steps (overflow steps always).
      divergence_patience: stop after this many consecutive overflows at the
        scale floor (None: never).
      auto_fallback_after: move a module to FP32 after this many overflows
        blamed on it (None: never).
      history_maxlen: records kept in memory.
    """

    def __init__(self, log_every_n_steps: int = 50, divergence_patience: int | None = None,
                 auto_fallback_after: int | None = None, history_maxlen: int = 100_000) -> None:
        if not isinstance(log_every_n_steps, int) or log_every_n_steps < 1:
            raise ValueError(f"log_every_n_steps={log_every_n_steps!r} must be an integer >= 1")
        self.log_every_n_steps = log_every_n_steps
        self.history = History(maxlen=history_maxlen)
        self.guard = DivergenceGuard(divergence_patience) if divergence_patience else None
        self.fallback = FallbackTracker(auto_fallback_after) if auto_fallback_after else None

    def should_log(self, step: int) -> bool:
        """True on every ``log_every_n_steps``-th step (1-based: steps N, 2N, ...)."""
        return step % self.log_every_n_steps == 0

    def record(self, stats: StepStats, min_scale: float = 0.0) -> list[str]:
        """Keep ``stats``; returns the modules that must move to FP32 now (auto-fallback).

        Raises :class:`~mp_callbacks.meters.DivergenceError` from the guard.
        """
        self.history.append(stats)
        moved: list[str] = []
        if stats.overflow:
            self.history.add_event("overflow", step=stats.step, scale=stats.scale,
                                   module=stats.overflow_module)
            if self.fallback is not None and stats.overflow_module:
                if self.fallback.blame_module(stats.overflow_module):
                    moved.append(stats.overflow_module)
                    self.history.add_event("fallback", step=stats.step, module=stats.overflow_module,
                                           overflows=self.fallback.blame[stats.overflow_module])
        if self.guard is not None:
            self.guard.observe(stats.step, stats.scale, min_scale, stats.overflow, stats.overflow_module)
        return moved

    def observe_clean(self) -> None:
        """A clean step that is not logged: only the guard's streak needs to know."""
        if self.guard is not None:
            self.guard.streak = 0

    # -- checkpoints ------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "schema_version": MONITOR_SCHEMA_VERSION,
            "history": self.history.state_dict(),
            "guard": self.guard.state_dict() if self.guard else None,
            "fallback": self.fallback.state_dict() if self.fallback else None,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        version = state.get("schema_version") if isinstance(state, Mapping) else None
        if version != MONITOR_SCHEMA_VERSION:
            raise ValueError(f"monitor state has schema_version={version!r}; expected {MONITOR_SCHEMA_VERSION}")
        self.history.load_state_dict(state["history"])
        if self.guard is not None and state.get("guard"):
            self.guard.load_state_dict(state["guard"])
        if self.fallback is not None and state.get("fallback"):
            self.fallback.load_state_dict(state["fallback"])
