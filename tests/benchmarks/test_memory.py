"""memory.py: bytes per parameter held at the optimizer step and the estimate, per recipe (the app's runners)."""

from __future__ import annotations

import memory
import pytest


def test_lightning_rows():
    rows = memory.main(["--frameworks", "lightning", "--recipes", "bf16-master", "bf16-sr[state_dtype=bfloat16]",
                        "--steps", "2", "--hidden", "16", "--batch-size", "8"])
    assert [r["recipe"] for r in rows] == ["bf16-master", "bf16-sr[state_dtype=bfloat16]"]
    for r in rows:
        assert "error" not in r, r
        assert r["held_bytes_per_param"] > 0 and r["estimate_bytes_per_param"] > 0 and r["params"] > 0


@pytest.mark.slow
def test_keras_rows():
    rows = memory.main(["--frameworks", "keras", "--recipes", "bf16-master", "--steps", "2", "--hidden", "16",
                        "--batch-size", "8"])
    assert "error" not in rows[0] and rows[0]["held_bytes_per_param"] > 0
