"""overhead.py on a tiny transformer: every row of a framework gets its ratios and its reference's control."""

from __future__ import annotations

import math

import overhead
import pytest

from tests.benchmarks import TINY

QUICK = ["--rounds", "2", "--steps", "2", "--warmup", "1", "--no-pin", *TINY]


def _check(section: dict, rows: int) -> None:
    assert len(section["ratios"]) == rows
    for r in section["ratios"]:
        assert r["ours"].startswith("ours ") and r["reference"].startswith("native ")
        for key in ("wall", "cpu", "control_wall", "control_cpu"):
            assert math.isfinite(r[key]["median"]) and r[key]["median"] > 0, (r["ours"], key)


def test_lightning_trainer_and_fabric_rows(capsys):
    results = overhead.main(["--frameworks", "trainer", "fabric", "--only", "bf16-master", *QUICK])
    assert [s["framework"] for s in results] == ["trainer", "fabric"]
    for section in results:  # bf16-master against native bf16-mixed, and both with AdamW(fused=True)
        _check(section, 2)
        assert section["ratios"][1]["reference"] == "native bf16-mixed, AdamW(fused=True)"
    assert "| ours bf16-master | native bf16-mixed |" in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.multiprocess
def test_keras_rows_in_their_subprocess():
    results = overhead.main(["--frameworks", "keras", "--only", "bf16-mixed", *QUICK])
    _check(results[0], 1)
