"""mp_callbacks.app.session: a progress bar per run with its recipe and step, and failures as rows."""

from __future__ import annotations

import os
import time

import pytest

from mp_callbacks.app.compare import RunResult
from mp_callbacks.app.measurement import can_isolate, error_summary, run_isolated
from mp_callbacks.app.session import PlannedRun, in_process, run_plan, with_control


def _steps(recipe, progress):
    for i in range(3):
        time.sleep(0.11)  # the bar redraws at most every 0.1 s
        progress(i + 1)
    return RunResult.failure("lightning", recipe, "not a real run")


def _raises(recipe, progress):
    raise ValueError(f"{recipe} cannot\nmore detail")


def _dies(recipe, progress):
    os._exit(7)


def test_one_progress_bar_per_run_with_its_recipe_and_step(monkeypatch, capsys):
    monkeypatch.setenv("FORCE_COLOR", "1")  # a terminal: rich draws the bar
    monkeypatch.setenv("COLUMNS", "100")
    import rich

    monkeypatch.setattr(rich, "_console", None)  # rich's global console reads FORCE_COLOR when it is made: anew here
    run_plan([PlannedRun("lightning", "bf16-master", _steps, ("bf16-master",), 3)], in_process)
    out = capsys.readouterr().out
    assert "lightning bf16-master" in out and "3/3" in out


def test_a_run_that_raises_is_a_failed_row_with_the_first_line():
    [row] = run_plan([PlannedRun("keras", "16-mixed", _raises, ("16-mixed",), 3)], in_process, quiet=True)
    assert row.error == "ValueError: 16-mixed cannot" and "more detail" in row.error_detail
    assert row.framework == "keras" and row.recipe == "16-mixed" and row.outcome().ran is False


@pytest.mark.skipif(not can_isolate(), reason="needs fork")
def test_a_run_whose_process_dies_is_a_failed_row():
    plan = [PlannedRun("keras", "16-mixed", _dies, ("16-mixed",), 3),
            PlannedRun("keras", "32-true", _raises, ("32-true",), 3, control=True)]
    died, raised = run_plan(plan, run_isolated, quiet=True)
    assert died.error.startswith("the run's process died") and died.isolated
    assert raised.error == "ValueError: 32-true cannot" and raised.control


def test_keras_wrapper_lines_get_their_cause():
    exc = TypeError("Exception encountered when calling TransformerDecoder.call().\n\n"
                    "\x1b[1mInput 'y' of 'AddV2' Op has type float32 that does not match type bfloat16\x1b[0m\n")
    assert error_summary(exc) == ("TypeError: Exception encountered when calling TransformerDecoder.call(): Input 'y' "
                                  "of 'AddV2' Op has type float32 that does not match type bfloat16")


def test_32_true_runs_first_and_again_last():
    assert with_control(["bf16-master", "16-mixed", "bf16-master"]) == [
        ("32-true", False), ("bf16-master", False), ("16-mixed", False), ("32-true", True)]
    assert with_control(["bf16-sr", "32-true"])[0] == ("bf16-sr", False)  # the given order is kept
