"""How ``mpx compare`` measures a run: step-time windows, peak anonymous memory, a process per run.

Framework-free and shared by both runners (:mod:`mp_callbacks.app.lightning_runner`,
:mod:`mp_callbacks.app.keras_runner`) and
the benchmarks; :mod:`mp_callbacks.app.compare` re-exports everything here.

How it measures (the same for every run, so that no figure depends on run order):

* each run goes in a fresh process (:func:`run_isolated`: a fork of the CLI, which has imported
  the frameworks but run nothing), so memory is never reused from an earlier run;
* memory: peak anonymous resident memory above the run's start (:class:`PeakRSS`), split into
  model state (weights, gradients, FP32 masters, optimizer state: the bytes the runner counts at
  the optimizer step) and the rest (activations, temporaries, framework buffers);
* step time: the steps after warm-up are cut into consecutive windows; a window's figure is
  its mean step, the run's figure the median window, with the min and max window as spread
  (:func:`step_timing`);
* a control: ``32-true`` runs again, last (``control=True``): its ratio to the first
  ``32-true`` run is the noise every ratio of the report carries.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import re
import statistics
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

WARMUP_FRACTION = 0.1
"""Share of a run's first steps left out of the timing (tracing, allocator warm-up); at least one step."""
WINDOWS = 5
"""Timed windows per run (fewer when there are fewer timed steps)."""


@dataclasses.dataclass(frozen=True)
class StepTiming:
    """Step time of a run: the median of its timed windows' mean steps, and the spread of the windows."""

    median_ms: float
    min_ms: float
    max_ms: float
    windows_ms: tuple[float, ...]

    @property
    def spread(self) -> float:
        """(max - min) / median of the windows."""
        return (self.max_ms - self.min_ms) / self.median_ms if self.median_ms else float("nan")


def step_timing(seconds: Sequence[float], windows: int = WINDOWS,
                warmup: float = WARMUP_FRACTION) -> StepTiming:
    """:class:`StepTiming` of per-step wall times (seconds, in step order).

    The first ``warmup`` share of the steps (at least one, when there are two or more) is left out;
    the rest is cut into up to ``windows`` consecutive windows of (nearly) equal size.
    """
    times = list(seconds)
    if not times:
        raise ValueError("no step times")
    skip = max(1, int(len(times) * warmup)) if len(times) > 1 else 0
    timed = times[skip:]
    k = max(1, min(windows, len(timed)))
    bounds = [round(i * len(timed) / k) for i in range(k + 1)]
    means = tuple(1000 * statistics.fmean(timed[a:b]) for a, b in zip(bounds, bounds[1:]))
    return StepTiming(statistics.median(means), min(means), max(means), means)


class PeakRSS:
    """Samples this process's anonymous resident memory in a thread; ``peak_mb`` above the start.

    Anonymous memory (heap, tensors, arrays) only: file-backed pages (the frameworks' libraries,
    paged in as code runs) are not the run's data.
    """

    def __init__(self, interval: float = 0.005) -> None:
        self.interval = interval
        self.start = self.peak = _rss_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, _rss_bytes())
            time.sleep(self.interval)

    def __enter__(self) -> PeakRSS:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss_bytes())

    @property
    def peak_mb(self) -> float:
        return (self.peak - self.start) / 2**20


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as fh:
            fields = fh.read().split()
        return (int(fields[1]) - int(fields[2])) * os.sysconf("SC_PAGE_SIZE")  # resident - file-backed/shared
    except OSError:  # not Linux: fall back to the high-water mark
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_WRAPPER = re.compile(r"^Exception encountered when calling .*\.$")  # Keras' wrapper line: the cause follows


def error_summary(exc: BaseException) -> str:
    """``Type: first line of the message`` (Keras' "Exception encountered when calling X" wrapper line gets
    the next non-empty line, its cause, appended)."""
    lines = [line.strip() for line in _ANSI.sub("", str(exc)).splitlines() if line.strip()]
    text = lines[0] if lines else ""
    if _WRAPPER.match(text) and len(lines) > 1:
        text = f"{text[:-1]}: {lines[1]}"
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class IsolatedRunError(RuntimeError):
    """A run in a child process raised (``summary``: :func:`error_summary` of the child's exception,
    ``detail``: its traceback) or died without a result."""

    def __init__(self, message: str, summary: str, detail: str = "") -> None:
        super().__init__(message)
        self.summary, self.detail = summary, detail


def can_isolate() -> bool:
    """Whether :func:`run_isolated` gives each run a process of its own (POSIX fork, not macOS)."""
    return hasattr(os, "fork") and sys.platform != "darwin"


def run_isolated(fn: Callable[..., Any], *args: Any, progress: Callable[[int], None] | None = None) -> Any:
    """``fn(*args, progress)`` in a forked child process; returns its result (pickled back).

    The child starts from the caller's memory (frameworks imported, nothing run: the caller must not
    have started thread pools) and leaves with ``os._exit``, so nothing it allocated or cached reaches
    the next run.  ``progress(n)`` calls are forwarded to the caller's ``progress``.  An exception in
    the child is raised here as :class:`IsolatedRunError` (a ``RuntimeError``) with the child's traceback.  Without fork
    (:func:`can_isolate` false) it runs ``fn`` in this process.
    """
    if not can_isolate():
        return fn(*args, progress)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child
        os.close(read)
        code = 0
        try:
            with os.fdopen(write, "wb") as out:
                def send(n: int) -> None:
                    pickle.dump(("progress", n), out)
                    out.flush()
                try:
                    message: tuple[str, Any] = ("result", fn(*args, send))
                except BaseException as exc:  # noqa: BLE001 - everything goes back to the parent
                    message = ("error", (error_summary(exc), traceback.format_exc()))
                pickle.dump(message, out)
        except BaseException:  # noqa: BLE001 - the pipe is gone: nothing to report to
            code = 1
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    os.close(write)
    result: tuple[str, Any] | None = None
    with os.fdopen(read, "rb") as inp:
        while True:
            try:
                kind, value = pickle.load(inp)
            except EOFError:
                break
            if kind == "progress":
                if progress is not None:
                    progress(value)
            else:
                result = (kind, value)
    _, status = os.waitpid(pid, 0)
    if result is None:
        died = f"the run's process died (wait status {status}) without a result"
        raise IsolatedRunError(f"the isolated run {getattr(fn, '__qualname__', fn)}: {died}", died)
    if result[0] == "error":
        summary, detail = result[1]
        raise IsolatedRunError(f"the isolated run failed:\n{detail}", summary, detail)
    return result[1]
