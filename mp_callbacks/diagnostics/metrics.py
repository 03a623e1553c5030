"""Shared diagnostics: metric names, per-step records and a bounded history.

Both frameworks log the same names (:data:`METRICS`) through their own
channels.  A :class:`History` keeps the last ``maxlen`` :class:`StepStats` and
exports/imports JSON lines; it is plain data, so it can live in checkpoints.
No framework is imported here (matplotlib only inside :func:`plot`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections import deque
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from .meters import fraction

#: The loss scale the step's gradients were produced with (before the step's scaler transition).
SCALE = "mp/scale"
#: 1.0 when the step's gradients held an inf/NaN (the step was skipped), else 0.0.
OVERFLOW = "mp/overflow"
#: Overflow steps so far (after this step).
OVERFLOWS_TOTAL = "mp/overflows_total"
#: Optimizer steps skipped so far (after this step).
SKIPPED_TOTAL = "mp/skipped_total"
#: Scale growths so far (after this step).
GROWTHS_TOTAL = "mp/growths_total"
#: Global L2 norm of the unscaled FP32 gradients (logging steps only).
GRAD_NORM = "mp/grad_norm"
#: Share of non-zero gradients that flush to zero in the compute dtype at the scale (see :mod:`.meters`).
GRAD_UNDERFLOW_FRAC = "mp/grad_underflow_frac"
#: Share of non-zero updates lost in the storage dtype without a master (see :mod:`.meters`).
UPDATE_SWAMPED_FRAC = "mp/update_swamped_frac"
#: Text: the first non-finite module of an overflow step (history/checkpoint/text loggers, never a metric).
OVERFLOW_MODULE = "mp/overflow_module"
#: ``fp8-mixed``, per FP8 tensor (``mp/fp8_amax/<matmul>/<role>``): this step's max |x| of the tensor.
FP8_AMAX = "mp/fp8_amax"
#: ``fp8-mixed``, per FP8 tensor (``mp/fp8_scale/<matmul>/<role>``): its scale after the step (what the next
#: step quantizes with under delayed scaling).
FP8_SCALE = "mp/fp8_scale"
#: ``fp8-mixed``: share of the FP8 tensors' elements clipped at the format's max this step (all tensors;
#: per tensor under ``mp/fp8_saturated_frac/<matmul>/<role>``).
FP8_SATURATED_FRAC = "mp/fp8_saturated_frac"
#: ``fp8-mixed``: share of the FP8 tensors' non-zero elements that became 0 in FP8 this step (all tensors;
#: per tensor under ``mp/fp8_underflow_frac/<matmul>/<role>``).
FP8_UNDERFLOW_FRAC = "mp/fp8_underflow_frac"

METRICS = (
    SCALE, OVERFLOW, OVERFLOWS_TOTAL, SKIPPED_TOTAL, GROWTHS_TOTAL, GRAD_NORM,
    GRAD_UNDERFLOW_FRAC, UPDATE_SWAMPED_FRAC, OVERFLOW_MODULE,
)
"""Every shared metric name, in logging order."""

FP8_METRICS = (FP8_AMAX, FP8_SCALE, FP8_SATURATED_FRAC, FP8_UNDERFLOW_FRAC)
"""The ``fp8-mixed`` metric names (per tensor: ``<name>/<matmul>/<role>``; the fractions also bare)."""


def fp8_metrics(names: list[str], roles: tuple[str, ...], amax: Any, scale: Any,
                counts: Any = None) -> dict[str, float]:
    """The FP8 metrics of one step from host arrays: ``amax[r][i]`` and ``scale[r][i]`` for role ``r`` of
    matmul ``names[i]``; ``counts[r][i] = (saturated, flushed, total)`` element counts (None: not measured).

    Per tensor ``mp/fp8_amax/<name>/<role>`` and ``mp/fp8_scale/<name>/<role>``; with counts, per tensor
    fractions and the element-weighted shares over all tensors under the bare names.
    """
    out: dict[str, float] = {}
    sat = flushed = total = 0.0
    for role in roles:
        for i, name in enumerate(names):
            out[f"{FP8_AMAX}/{name}/{role}"] = float(amax[role][i])
            out[f"{FP8_SCALE}/{name}/{role}"] = float(scale[role][i])
            if counts is not None:
                s, f, n = (float(v) for v in counts[role][i])
                out[f"{FP8_SATURATED_FRAC}/{name}/{role}"] = fraction(s, n)
                out[f"{FP8_UNDERFLOW_FRAC}/{name}/{role}"] = fraction(f, n)
                sat, flushed, total = sat + s, flushed + f, total + n
    if counts is not None:
        out[FP8_SATURATED_FRAC] = fraction(sat, total)
        out[FP8_UNDERFLOW_FRAC] = fraction(flushed, total)
    return out

#: Logged at train start and end: bytes of model state actually held per parameter (see :func:`memory_metrics`).
MEMORY_BYTES_PER_PARAM = "mp/memory_bytes_per_param"
#: Logged next to it: :func:`mp_callbacks.memory.estimate.estimate_memory` for the same parameters.
MEMORY_ESTIMATE_BYTES_PER_PARAM = "mp/memory_bytes_per_param_estimate"

HISTORY_SCHEMA_VERSION = 1


def memory_metrics(report: Mapping[str, Any]) -> dict[str, float]:
    """The memory metrics of a :func:`mp_callbacks.memory.estimate.memory_report` (the estimate only when known)."""
    out = {MEMORY_BYTES_PER_PARAM: float(report["actual"]["bytes_per_param"])}
    if report.get("estimate") is not None:
        out[MEMORY_ESTIMATE_BYTES_PER_PARAM] = float(report["estimate"]["bytes_per_param"])
    return out


@dataclasses.dataclass
class StepStats:
    """What one optimizer step looked like.  Optional fields are None when not measured."""

    step: int
    scale: float
    overflow: bool
    overflows_total: int
    skipped_total: int
    growths_total: int
    loss: float | None = None
    grad_norm: float | None = None
    grad_underflow_frac: float | None = None
    update_swamped_frac: float | None = None
    overflow_module: str | None = None
    fp8: dict[str, float] | None = None

    def metrics(self) -> dict[str, float | str]:
        """The shared metric names -> values (unmeasured ones left out)."""
        out: dict[str, float | str] = {
            SCALE: float(self.scale), OVERFLOW: float(self.overflow),
            OVERFLOWS_TOTAL: float(self.overflows_total), SKIPPED_TOTAL: float(self.skipped_total),
            GROWTHS_TOTAL: float(self.growths_total),
        }
        for name, value in ((GRAD_NORM, self.grad_norm), (GRAD_UNDERFLOW_FRAC, self.grad_underflow_frac),
                            (UPDATE_SWAMPED_FRAC, self.update_swamped_frac)):
            if value is not None:
                out[name] = float(value)
        if self.overflow_module is not None:
            out[OVERFLOW_MODULE] = self.overflow_module
        if self.fp8:
            out.update({k: float(v) for k, v in self.fp8.items()})
        return out

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-safe data: every field, non-finite floats as strings (``"inf"``, ``"nan"``)."""
        return {k: json_safe(v) for k, v in dataclasses.asdict(self).items()}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> StepStats:
        """Inverse of :meth:`to_dict`; an unknown field is a ``ValueError`` naming the valid ones."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"unknown StepStats field(s) {unknown}; valid: {sorted(names)}")
        return cls(**{k: ({n: _from_json_number(x) for n, x in v.items()} if isinstance(v, Mapping) else
                          _from_json_number(v)) for k, v in data.items()})

    @classmethod
    def from_counts(cls, step: int, scale: float, overflow: bool, overflows_total: float, skipped_total: float,
                    growths_total: float, loss: float | None = None, grad_norm: float | None = None,
                    underflow: tuple[float, float] | None = None, swamped: tuple[float, float] | None = None,
                    overflow_module: str | None = None, fp8: Mapping[str, float] | None = None) -> StepStats:
        """A record from the numbers an adapter read back (host floats).

        ``underflow`` / ``swamped`` are the meters' ``(lost, total)`` counts
        (None: not measured), turned into shares with
        :func:`~mp_callbacks.diagnostics.meters.fraction`; the counters are rounded to ints.
        """
        return cls(step=int(step), scale=float(scale), overflow=bool(overflow),
                   overflows_total=int(overflows_total), skipped_total=int(skipped_total),
                   growths_total=int(growths_total), loss=None if loss is None else float(loss),
                   grad_norm=None if grad_norm is None else float(grad_norm),
                   grad_underflow_frac=None if underflow is None else fraction(*underflow),
                   update_swamped_frac=None if swamped is None else fraction(*swamped),
                   overflow_module=overflow_module, fp8=dict(fp8) if fp8 else None)


def json_safe(value: Any) -> Any:
    """``value`` with every non-finite float stored as a string (JSON has no inf/NaN), recursively.

    Mappings (keys as strings) and lists/tuples (as lists) are walked; other values pass through.
    """
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, Mapping):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def _from_json_number(value: Any) -> Any:
    if value in ("inf", "-inf", "nan"):
        return float(value)
    return value


class History:
    """The last ``maxlen`` steps, plus events (overflow attributions, fallbacks)."""

    def __init__(self, maxlen: int = 100_000) -> None:
        if not isinstance(maxlen, int) or maxlen < 1:
            raise ValueError(f"History maxlen={maxlen!r} must be an integer >= 1")
        self.maxlen = maxlen
        self._steps: deque[StepStats] = deque(maxlen=maxlen)
        self.events: deque[dict[str, Any]] = deque(maxlen=maxlen)

    def append(self, stats: StepStats) -> None:
        """Keep one step's record (the oldest is dropped past ``maxlen``)."""
        self._steps.append(stats)

    def add_event(self, kind: str, **fields: Any) -> None:
        """Record something that happened (``kind``: e.g. ``"overflow"``, ``"fallback"``)."""
        self.events.append({"kind": kind, **fields})

    def __len__(self) -> int:
        return len(self._steps)

    def __iter__(self) -> Iterator[StepStats]:
        return iter(self._steps)

    def __getitem__(self, index: int) -> StepStats:
        return self._steps[index]

    def series(self, name: str) -> list[Any]:
        """Values of a metric name (``mp/scale``, ``mp/fp8_scale/<matmul>/<role>``) or a field (``loss``) in
        step order (None where a step did not log it)."""
        if name.startswith("mp/fp8_"):
            return [(s.fp8 or {}).get(name) for s in self._steps]
        field = name.removeprefix("mp/")
        return [getattr(s, field) for s in self._steps]

    # -- plain data -------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Plain data: schema version, ``maxlen``, the steps (:meth:`StepStats.to_dict`) and the events."""
        return {"schema_version": HISTORY_SCHEMA_VERSION, "maxlen": self.maxlen,
                "steps": [s.to_dict() for s in self._steps], "events": list(self.events)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Replace the contents with a :meth:`state_dict`; another schema version is a ``ValueError``."""
        version = state.get("schema_version") if isinstance(state, Mapping) else None
        if version != HISTORY_SCHEMA_VERSION:
            raise ValueError(f"history state has schema_version={version!r}; expected {HISTORY_SCHEMA_VERSION}")
        self.maxlen = int(state["maxlen"])
        self._steps = deque((StepStats.from_dict(s) for s in state["steps"]), maxlen=self.maxlen)
        self.events = deque(state["events"], maxlen=self.maxlen)

    def to_jsonl(self, path: str | os.PathLike[str]) -> None:
        """One JSON object per step, then one per event (``{"event": {...}}``)."""
        with open(path, "w", encoding="utf-8") as fh:
            for s in self._steps:
                fh.write(json.dumps(s.to_dict()) + "\n")
            for e in self.events:
                fh.write(json.dumps({"event": e}) + "\n")

    @classmethod
    def from_jsonl(cls, path: str | os.PathLike[str], maxlen: int = 100_000) -> History:
        """Read a file written by :meth:`to_jsonl`; a line that is not JSON is a ``ValueError`` naming it."""
        history = cls(maxlen=maxlen)
        with open(path, encoding="utf-8") as fh:
            for number, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    data = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{path}:{number}: not JSON ({exc})") from None
                if "event" in data:
                    history.events.append(data["event"])
                else:
                    history.append(StepStats.from_dict(data))
        return history

    @classmethod
    def from_steps(cls, steps: Iterable[StepStats], maxlen: int = 100_000) -> History:
        """A history holding ``steps`` (in order, no events)."""
        history = cls(maxlen=maxlen)
        for s in steps:
            history.append(s)
        return history


def plot(history: History, path: str | os.PathLike[str], title: str = "") -> None:
    """Draw the loss-scale curve with overflow markers, and the loss, to ``path`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [s.step for s in history]
    if not steps:
        raise ValueError("cannot plot an empty history")
    losses = [s.loss for s in history]
    has_loss = any(v is not None for v in losses)
    fig, axes = plt.subplots(2 if has_loss else 1, 1, figsize=(8, 6 if has_loss else 3.5),
                             sharex=True, squeeze=False)
    ax = axes[0][0]
    ax.step(steps, [s.scale for s in history], where="post", label="loss scale")
    over = [(s.step, s.scale) for s in history if s.overflow]
    if over:
        ax.scatter(*zip(*over), color="red", marker="x", zorder=3, label="overflow (skipped)")
    ax.set_yscale("log", base=2)
    ax.set_ylabel("scale")
    ax.legend(loc="best")
    if title:
        ax.set_title(title)
    if has_loss:
        lx = [st for st, v in zip(steps, losses) if v is not None and math.isfinite(v)]
        ly = [v for v in losses if v is not None and math.isfinite(v)]
        axes[1][0].plot(lx, ly)
        axes[1][0].set_ylabel("loss")
    axes[-1][0].set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
