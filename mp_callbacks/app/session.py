"""One ``mpx compare`` session: the machine's notes, the runs with their progress bars, the printed summary.

Shared by the built-in model (:func:`mp_callbacks.app.cli.compare`) and a model of the user's
(:mod:`mp_callbacks.app.own_model`): :func:`machine_notes` probes the CPU, :func:`run_plan` runs each
planned run (in a process of its own when it can) under one progress bar that shows its recipe and
step, and records a run that raises or dies as a failed run; :func:`finish` prints the table, the
recommendation and writes the report, ending on the line that points at it.
"""

from __future__ import annotations

import dataclasses
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from .compare import RunResult
from .measurement import IsolatedRunError, can_isolate, error_summary, run_isolated
from .report import ReportSpec, control_ratios, format_table, recommendation_lines, recommendations, write_report

Caller = Callable[..., Any]
"""``call(fn, *args, progress=...)``: :func:`run_isolated`, or the same signature in this process."""


def quiet_frameworks() -> None:
    """Hide the frameworks' chatter: TF's C++ info logs (call before TF is imported) and, once
    Lightning is imported (it sets its own level on import), its per-fit info lines and tips."""
    import logging
    import os
    import warnings

    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    for name in ("lightning.pytorch", "lightning.fabric", "lightning_fabric", "pytorch_lightning"):
        logging.getLogger(name).setLevel(logging.WARNING)
    for message in (r".*does not have many workers.*", r".*GPU available but not used.*",
                    r".*isinstance\(treespec, LeafSpec\)` is deprecated.*", r".*but have no `val_dataloader`.*",
                    r".*computes in float16 on a CPU without native float16.*"):  # the CPU notes say it
        warnings.filterwarnings("ignore", message=message)


def in_process(fn: Callable[..., Any], *args: Any, progress: Callable[[int], None] | None = None) -> Any:
    """``fn(*args, progress)`` here (``--in-process``, or where there is no fork)."""
    return fn(*args, progress)


def caller(isolate: bool) -> Caller:
    """How runs are called: a forked child each (``isolate``) or this process."""
    return run_isolated if isolate and can_isolate() else in_process


@dataclasses.dataclass(frozen=True)
class PlannedRun:
    """One run of a session: ``fn(*args, progress) -> RunResult``; ``control``: the second ``32-true``."""

    framework: str
    recipe: str
    fn: Callable[..., RunResult]
    args: tuple[Any, ...]
    steps: int
    control: bool = False

    @property
    def label(self) -> str:
        return f"{self.framework} {self.recipe}" + (" (control)" if self.control else "")


def with_control(recipes: Sequence[str]) -> list[tuple[str, bool]]:
    """``(recipe, control)`` in run order: ``32-true`` first (added when missing), the control last."""
    recipes = list(dict.fromkeys(recipes))
    if "32-true" not in recipes:
        recipes.insert(0, "32-true")
    return [(r, False) for r in recipes] + [("32-true", True)]


def machine_notes(call: Caller, slowdown: dict[str, float] | None, probe: Callable[..., dict[str, float]],
                  ) -> tuple[dict[str, Any], list[str]]:
    """``(machine, notes)``: the CPU, its features and the matmul probe (run through ``call``: the runs fork
    from this process, which runs nothing itself), and what they mean per recipe."""
    from .machine import cpu_model, features, recipe_notes

    if slowdown is None:
        slowdown = call(probe)
    found = features()
    machine = {"cpu": cpu_model() or "unknown CPU", "features": found, "matmul_slowdown_vs_float32": slowdown,
               "isolated_runs": call is run_isolated}
    return machine, [f"CPU: {machine['cpu']}", *recipe_notes(found, slowdown)]


def run_plan(plan: Sequence[PlannedRun], call: Caller, quiet: bool = False) -> list[RunResult]:
    """Every planned run, in order, each under a progress bar ``<framework> <recipe>  step/steps``;
    a run that raises (or whose process dies) becomes :meth:`RunResult.failure` with the error's first line."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    results = []
    with Progress(TextColumn("{task.description:<28}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), transient=True, disable=quiet, auto_refresh=False) as progress:
        for item in plan:
            task = progress.add_task(item.label, total=item.steps)
            try:
                result = call(item.fn, *item.args, progress=_throttled(progress, task))
            except IsolatedRunError as exc:
                result = RunResult.failure(item.framework, item.recipe, exc.summary, exc.detail or None)
            except Exception as exc:  # noqa: BLE001 - in-process: a failed run is a row of the report
                result = RunResult.failure(item.framework, item.recipe, error_summary(exc), traceback.format_exc())
            result.control, result.isolated = item.control, call is run_isolated
            results.append(result)
            progress.remove_task(task)
            if not quiet and result.error is not None:
                progress.console.print(f"{item.label}: failed: {result.error}", soft_wrap=True)
    return results


def _throttled(progress: Any, task: Any, every: float = 0.1) -> Callable[[int], None]:
    """``progress.update(task, completed=n)``, redrawn at most every ``every`` seconds (no refresh thread:
    the runs fork from this process)."""
    import time

    last = [0.0]

    def update(n: int) -> None:
        now = time.monotonic()
        draw = now - last[0] >= every
        if draw:
            last[0] = now
        progress.update(task, completed=n, refresh=draw)

    return update


def finish(results: Sequence[RunResult], spec: ReportSpec, out: str | Path | None, machine: dict[str, Any],
           notes: Sequence[str], goal: str = "speed", extra_notes: Sequence[str] = (),
           echo: Callable[[str], None] = print) -> tuple[Path | None, dict[str, Any]]:
    """Print the table, FP8 rows, control ratio and recommendation, write the report under ``out`` (None: no
    files; ``extra_notes`` appended to its README), print the line that points at it; returns
    ``(folder, recommendations)``."""
    from .fp8_report import fp8_table
    from .machine import slowdown_notes

    echo(format_table(results))
    fp8 = fp8_table(results)
    if fp8:
        echo("\nFP8 tensors (fp8-mixed):\n" + fp8)
    ratios = control_ratios(results)
    if ratios:
        echo("control: 32-true(ctl) step time / 32-true's: " + ", ".join(f"{fw} {v:.3f}" for fw, v in ratios.items())
             + " (32-true run again, last; 1 = no run-to-run noise: every speed-up above carries this much)")
    if not machine.get("isolated_runs"):
        echo("note: every run shared this process (--in-process or no fork here): memory figures depend on run order")
    slow = slowdown_notes(machine.get("features", {}))
    slow.update({r.recipe: slow[base] for r in results  # a label (fp8-mixed[rowwise]) has its recipe's note
                 if (base := r.recipe.partition("[")[0]) in slow and r.recipe not in slow})
    recs = recommendations(results, goal, slow)
    echo("\n" + "\n".join(recommendation_lines(recs)))
    for note in extra_notes:
        echo(f"\nnote: {note}")
    if out is None:
        return None, recs
    folder = write_report(results, spec, out, machine=machine, notes=notes, recommended=recs)
    if extra_notes:
        with open(folder / "README.md", "a") as fh:
            fh.writelines(f"\nNote: {note}\n" for note in extra_notes)
    echo(f"\nreport written to {folder}/ (README.md, results.json, *.jsonl, *.png)")
    return folder, recs
