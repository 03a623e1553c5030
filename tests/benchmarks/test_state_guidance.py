"""``benchmarks/state_guidance.py``'s table functions give one row per label with every column measured
(tiny sizes; no figure asserted but the ones with a reference: 32-true against itself, the estimator's bytes)."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import state_guidance as sg  # noqa: E402

from mp_callbacks.app.compare import RunSpec  # noqa: E402
from mp_callbacks.memory import bytes_per_param  # noqa: E402
from mp_callbacks.recipes import get_recipe  # noqa: E402

LABELS = ["32-true", "bf16-master[master_remainders]", "bf16-sr[state_dtype=bfloat16]"]  # bf16-master: the baseline


def test_every_label_the_five_recipes_accept_is_a_row():
    assert {get_recipe(label).name for label in sg.LABELS} == {"32-true", "bf16-mixed", "bf16-master", "bf16-kahan",
                                                               "bf16-sr"}
    kinds = {(get_recipe(label).name, get_recipe(label).master.state_dtype) for label in sg.LABELS}
    assert {("bf16-kahan", d) for d in ("float32", "bfloat16", "8bit")} <= kinds
    assert {("bf16-sr", d) for d in ("float32", "bfloat16", "8bit")} <= kinds


def test_rows_have_every_column_and_the_table_shows_them():
    spec = RunSpec(steps=2, batch_size=16, hidden=16, depth=1, threads=1)
    rows, raw = sg.guidance_rows(LABELS, hidden=16, depth=1, rounds=1, steps=1, swamp_steps=3, swamp_lr=1e-5,
                                 task_spec=spec, seeds=[0], frameworks=["lightning"])
    assert [r.label for r in rows] == LABELS
    for row in rows:
        # no 8-bit state here, every tensor in the recipe's dtype: the per-parameter figure of the plan
        assert row.bytes_per_param == pytest.approx(bytes_per_param(get_recipe(row.label).master, "adamw"))
        assert all(math.isfinite(row.step_ratio[k]) and row.step_ratio[k] > 0 for k in ("median", "min", "max"))
        assert math.isfinite(row.swamp_error) and set(row.accuracy_delta) == {"lightning"}
    by_label = {r.label: r for r in rows}
    assert by_label["32-true"].swamp_error == 0.0 and by_label["32-true"].accuracy_delta["lightning"] == 0.0
    assert raw["step"]["ratios"][sg.BASELINE]["cpu"]["median"] == 1.0  # the baseline against itself, round by round
    assert raw["swamp"][sg.ROUNDED] >= 0.0 and "control" in raw["step"]
    table = sg.markdown_table(rows, raw, ["lightning"])
    lines = [line for line in table.splitlines() if line.startswith("| `")]
    assert len(lines) == len(LABELS)
    assert "| `bf16-sr` | bfloat16 | 8.00 |" in table and "`bf16-master (master_remainders)` | float32 | 14.00" in table
    assert "control (bf16-master / bf16-master)" in table and sg.ROUNDED in table
