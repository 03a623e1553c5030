"""``benchmarks/gpu_check.py --cpu-dry-run`` runs the GPU check's code paths on the CPU with tiny sizes.

It keeps the script working where no GPU is: every recipe gets a row with finite figures, the
Markdown table is written, and every part that needs CUDA says "skipped: no CUDA".  No timing is
asserted (tiny models on a shared CPU).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
RECIPES = ["32-true", "16-mixed", "bf16-mixed", "bf16-master", "bf16-kahan", "bf16-sr", "fp8-mixed"]
NO_CUDA = "skipped: no CUDA"


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v) and v > 0


def test_the_cpu_dry_run_writes_every_row(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    env.pop("MP_CUDA_TESTS_DEVICE", None)
    proc = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--cpu-dry-run", "--out", str(tmp_path)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert "errors" not in report, report.get("errors")
    md = (tmp_path / "gpu_check.md").read_text()
    assert md.startswith("# GPU check: CPU dry run") and "| recipe | ours steps/s |" in md
    assert "| recipe | CUDA allocator |" in md and md in proc.stdout  # the same table on stdout

    tests = report["pytest"]  # pytest -m cuda ran: every test collected and skipped (no CUDA here)
    assert tests["status"] == "passed" and tests["tests"] >= 1 and tests["skipped"] == tests["tests"], tests

    gpt = report["gpt2"]
    assert [r["recipe"] for r in gpt["rows"]] == RECIPES and gpt["rounds"] >= 1
    for row in gpt["rows"]:
        assert row["error"] is None, row
        for key in ("ours_steps_per_s", "native_steps_per_s", "step_time_ratio", "ratio_min", "ratio_max"):
            assert _finite(row[key]), (row["recipe"], key, row[key])
        assert _finite(row["control"]["median"]), row
        assert row["ours_peak_mb"] == row["native_peak_mb"] == NO_CUDA
    assert {r["recipe"] for r in report["bytes_per_param"]} == set(RECIPES)
    for row in report["bytes_per_param"]:
        assert _finite(row["held_bytes_per_param"]) and _finite(row["estimate_bytes_per_param"]), row
        assert row["allocated_bytes_per_param"] is None
    lin = report["linear_fp8"]
    assert not lin["errors"]
    for part in ("train", "forward"):
        assert len(lin[part]["ratios"]) == 3 and all(_finite(r["median"]) for r in lin[part]["ratios"]), lin[part]
    skipped = " ".join(report["skipped"])
    for what in ("peak memory", "CUDA allocator", "FP8 tensor cores", "pytest -m cuda"):
        assert what in skipped, what
    assert skipped.count(NO_CUDA) == 4 and NO_CUDA in md


def test_the_hugging_face_gpt2_path_on_cpu():
    """The GPU run's model (``transformers``' GPT2LMHeadModel, tied head) through the same fit and bytes/param code,
    tiny; skipped where ``transformers`` is not installed (it is no dependency of this project)."""
    pytest.importorskip("transformers")
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import gpu_check_parts as parts
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    sizes = dataclasses.replace(parts.DRY_SIZES, layers=1, d_model=32, heads=2, seq=16, vocab=64)
    template, desc = parts.gpt_template(sizes, use_hf=True)
    assert desc.startswith("transformers GPT2LMHeadModel")
    peaks, errors = {}, {}
    batches = parts.gpt_batches(sizes, 3, 2)
    for name in ("ours bf16-master", "ours fp8-mixed", "native 16-mixed"):
        seconds = parts.timed_variant(name, lambda: parts.LM(template), batches, 1, "cpu", peaks, errors)()
        assert not errors and math.isfinite(seconds) and seconds > 0, errors
    row = parts.bytes_per_param_row("bf16-master", template, parts.gpt_batches(sizes, 2, 1, 8), "cpu")
    assert row["held_bytes_per_param"] == pytest.approx(row["estimate_bytes_per_param"])
