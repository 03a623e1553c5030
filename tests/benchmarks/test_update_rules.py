"""update_rules.py: ours against the peers, timed in turns and scored against the FP32 run."""

from __future__ import annotations

import math

import update_rules

QUICK = ["--rounds", "1", "--steps", "2", "--warmup", "1", "--hidden", "16", "--batch-size", "8", "--no-pin"]


def test_ours_and_optimi_against_fp32():
    result = update_rules.main([*QUICK, "--no-torchao"])
    scores = result["scores"]
    assert scores["fp32"]["loss_vs_fp32"] == 0 and scores["fp32"]["weights_rel_l2"] == 0
    for name in ("ours bf16-master", "ours bf16-kahan", "ours bf16-sr", update_rules.OPTIMI):
        assert math.isfinite(scores[name]["loss"]) and scores[name]["weights_rel_l2"] > 0, name
    pairs = {(r["ours"], r["reference"]) for r in result["timing"]["ratios"]}
    assert ("ours bf16-kahan", update_rules.OPTIMI) in pairs and ("ours bf16-master", "fp32") in pairs
