"""``benchmarks/gpu_check.py --cpu-dry-run`` runs the GPU check's code paths on the CPU with tiny sizes.

It keeps the prepared script working where no GPU is: every section runs, every recipe gets its rows with finite
figures, the Markdown is written, and every part that needs CUDA says "skipped: no CUDA".  No timing is asserted
(tiny models on a shared CPU).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RECIPES = ["32-true", "16-mixed", "bf16-mixed", "16-master", "bf16-master", "bf16-kahan", "bf16-sr", "fp8-mixed"]
NO_CUDA = "skipped: no CUDA"


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v) and v > 0


def test_the_cpu_dry_run_writes_every_section(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    env.pop("MP_CUDA_TESTS_DEVICE", None)
    proc = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--cpu-dry-run", "--out", str(tmp_path)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert "errors" not in report, report.get("errors")
    md = (tmp_path / "gpu_check.md").read_text()
    assert md.startswith("# GPU check: CPU dry run") and md in proc.stdout  # the same Markdown on stdout

    tests = report["pytest"]  # pytest -m cuda ran: every test collected and skipped (no CUDA here)
    assert tests["status"] == "passed" and tests["tests"] >= 1 and tests["skipped"] == tests["tests"], tests

    counted = report["counter"]["rows"]  # launches.py's reduced form on the device (here the CPU)
    assert [r["recipe"] for r in counted] == ["16-mixed", "bf16-master"]
    assert all(r["ours_counts"]["ops"] > 0 and r["native_counts"]["ops"] > 0 for r in counted)
    assert "| ours 16-mixed, AdamW(fused=True) | native 16-mixed, AdamW(fused=True) |" in md

    assert [r["recipe"] for r in report["bytes_per_param"]] == RECIPES
    for row in report["bytes_per_param"]:
        assert _finite(row["estimate_bytes_per_param"]) and row["allocated_bytes_per_param"] is None, row

    gpt = report["gpt2"]
    assert [r["ours"] for r in gpt["ratios"]] == [f"ours {r}" for r in RECIPES] + [
        "ours bf16-master, AdamW(fused=True)"]
    for row in gpt["ratios"]:
        for key in ("wall", "cpu", "control_wall", "control_cpu"):
            assert _finite(row[key]["median"]), (row["ours"], key)
    assert all(v["peak_mb_above_rest"] is None for v in gpt["variants"].values())

    lin = report["linear_fp8"]
    for part in ("train", "forward"):
        assert len(lin[part]["ratios"]) == 3 and all(_finite(r["wall"]["median"]) for r in lin[part]["ratios"])
    assert set(lin["forward"]["scaled_mm_per_forward"]) == {"ours fp8-mixed forward", "ours bf16-mixed forward",
                                                            "native bf16-mixed forward"}
    skipped = " ".join(report["skipped"])
    for what in ("peak memory", "CUDA allocator", "FP8 tensor cores", "sync count", "pytest -m cuda"):
        assert what in skipped, what
    assert skipped.count(NO_CUDA) == 5 and NO_CUDA in md
