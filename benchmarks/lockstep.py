"""Step-by-step alternation: every variant's fit runs in its own thread, and the threads take turns per step.

:func:`common.alternate` alternates whole fits, so a slow phase of the machine that lasts less than a fit
lands on one variant only (on a shared 2-vCPU machine single steps of the same fit spread 12-22 ms).  Here
step ``k`` of every variant runs back to back, in one round, so the ratio of two variants at step ``k``
sees the same machine.  Each round runs the variants in a fresh random order (seeded: the same run
repeats), drawn again while its first variant is the previous round's last, so no variant runs twice in a
row; two variants alternate A B A B.  Reversing the order (A B C, C B A, as ``alternate`` does) would run
the end variants twice in a row at every round boundary, with their data still in the cache (measured: a
control 4% faster than its twin in the middle); rotating it by one (A B C, B C A) makes every variant
follow the same predecessor in every round, which biased whole tables (Keras: controls of 1.02-1.05 in
every run).  The rule:

* each variant is built in the main thread, one after the other (``torch.manual_seed`` and Keras' seeds
  are process-wide), then every fit starts in a thread of its own;
* a fit calls :meth:`StepClock.begin` when a training step starts and :meth:`StepClock.end` when it ends
  (a framework callback); ``begin`` waits for the variant's turn, so exactly one step runs at a time and
  the others wait without using the CPU;
* after its last step a fit waits until every fit has taken its last step, so no set-up or teardown runs
  beside a timed step;
* a step's figures are its wall time and its thread's CPU time (``time.thread_time``: another thread's
  waiting or teardown does not count); ``cpu=time.process_time`` for a framework that runs its kernels
  on threads of its own (TensorFlow's executor pools: the fits that wait use no CPU meanwhile).

The per-step times are cut into ``windows`` consecutive windows after ``warmup`` steps; a window's figure
is its median step: the rounds that :func:`common.print_tables` summarises (median of per-window ratios,
min-max over windows).
"""

from __future__ import annotations

import random
import statistics
import threading
import time
from collections.abc import Callable, Mapping

__all__ = ["StepClock", "lockstep"]


class _Turns:
    """Turns among the fits, in a fresh seeded random order every round, never the same fit twice in a row
    (the module's rule).  ``stop()`` (a fit failed) lets every fit run on without waiting."""

    def __init__(self, n: int, seed: int = 0) -> None:
        self.cond = threading.Condition()
        self.n = n
        self.pos = 0
        self.stopped = False
        self._rng = random.Random(seed)
        self.order = list(range(n))

    def _next_order(self) -> None:
        if self.n <= 2:  # A B A B: the only order with no fit twice in a row
            return
        last = self.order[-1]
        while True:
            order = self._rng.sample(range(self.n), self.n)
            if order[0] != last:
                self.order = order
                return

    def _current(self) -> int:
        return self.order[self.pos]

    def wait(self, i: int) -> None:
        with self.cond:
            self.cond.wait_for(lambda: self.stopped or self._current() == i)

    def passed(self) -> None:
        with self.cond:
            self.pos += 1
            if self.pos == self.n:
                self.pos = 0
                self._next_order()
            self.cond.notify_all()

    def stop(self) -> None:
        with self.cond:
            self.stopped = True
            self.cond.notify_all()


class StepClock:
    """One variant's step timer and turn: call :meth:`begin` at a step's start and :meth:`end` at its end."""

    def __init__(self, turns: _Turns, index: int, steps: int, done: threading.Barrier,
                 cpu: Callable[[], float] = time.thread_time) -> None:
        self._turns, self._index, self._steps, self._done, self._cpu = turns, index, steps, done, cpu
        self.times: list[tuple[float, float]] = []  # (wall, thread cpu) seconds per step
        self._t0 = self._c0 = 0.0

    def begin(self) -> None:
        """Wait for this variant's turn, then start the step's clocks."""
        self._turns.wait(self._index)
        self._t0, self._c0 = time.perf_counter(), self._cpu()

    def end(self) -> None:
        """Stop the clocks, pass the turn; after the last step, wait for every variant's last step."""
        self.times.append((time.perf_counter() - self._t0, self._cpu() - self._c0))
        self._turns.passed()
        if len(self.times) == self._steps:
            self._done.wait()


LEAD = "(lead: the first variant again, dropped)"


def lockstep(variants: Mapping[str, Callable[[StepClock], Callable[[], object]]], steps: int, windows: int,
             warmup: int | None = None, cpu: Callable[[], float] = time.thread_time, lead: bool = True,
             ) -> dict[str, list[tuple[float, float]]]:
    """Run the variants' fits step by step in turn; returns ``{name: [(wall, cpu) per window]}``.

    ``variants[name](clock)`` builds the variant (in the main thread, in order) and returns the function
    that trains it for ``steps`` steps, calling ``clock.begin()`` / ``clock.end()`` around every step.
    ``warmup`` steps (default: a tenth) are left out; the rest are cut into ``windows`` windows.
    ``cpu``: the CPU clock of a step (default the thread's; see the module's rule).
    ``lead``: build and run a copy of the first variant before the others, its figures dropped: the fit built
    (and started) first ran 1.3-1.5 % slower than an identical one built later (Lightning, Hugging Face GPT-2,
    2026-12-07, three orders: whichever variant came first), which no control built later shows.
    """
    if lead and variants:
        first = next(iter(variants.values()))
        variants = {LEAD: first, **variants}
    names = list(variants)
    turns = _Turns(len(names))
    done = threading.Barrier(len(names))
    clocks = [StepClock(turns, i, steps, done, cpu) for i in range(len(names))]
    fits = [variants[name](clock) for name, clock in zip(names, clocks)]
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            fits[i]()
            if len(clocks[i].times) != steps:
                raise RuntimeError(f"{names[i]!r} trained {len(clocks[i].times)} steps, not {steps}")
        except threading.BrokenBarrierError:
            pass  # another fit failed: its error is the one raised
        except BaseException as exc:  # noqa: BLE001 - re-raised in the main thread below
            errors.append(exc)
            turns.stop()
            done.abort()

    threads = [threading.Thread(target=run, args=(i,), name=f"lockstep-{name}") for i, name in enumerate(names)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    skip = steps // 10 if warmup is None else warmup
    out: dict[str, list[tuple[float, float]]] = {}
    for name, clock in zip(names, clocks):
        if name == LEAD:
            continue
        timed = clock.times[skip:]
        per = max(1, len(timed) // windows)
        out[name] = [(statistics.median(t[0] for t in timed[w * per:(w + 1) * per]),
                      statistics.median(t[1] for t in timed[w * per:(w + 1) * per]))
                     for w in range(min(windows, len(timed) // per))]
    return out
