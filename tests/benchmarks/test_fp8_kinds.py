"""fp8_kinds.py: the SNR table (ours against torchao's casts), the scale bytes, a short training comparison."""

from __future__ import annotations

import math

import fp8_kinds
import pytest


def test_snr_and_bytes():
    pytest.importorskip("torchao")
    out = fp8_kinds.main(["--parts", "snr", "bytes", "--ratios", "1e2", "1e5", "--shape", "256", "128", "64",
                          "--no-pin"])
    snr = {(r["case"], r["ratio"], r["kind"]): r for r in out["snr"]}
    assert len(snr) == 2 * 2 * 5
    for r in snr.values():  # the core's casts are torchao's, bit for bit, where torchao has a CPU cast
        assert r["torchao_db"] is None if r["kind"] == "blockwise" else r["torchao_db"] == pytest.approx(r["ours_db"])
    assert snr[("tokens", 1e5, "rowwise")]["ours_db"] > snr[("tokens", 1e5, "tensorwise")]["ours_db"] + 10
    by_kind = {r["kind"]: r for r in out["bytes"]}
    assert by_kind["tensorwise"]["activation_scale_bytes"] == 4 and by_kind["rowwise"]["weight_scale_bytes"] == 4 * 64
    assert by_kind["mxfp8"]["activation_scale_bytes"] == 256 * 128 // 32


def test_training_rows():
    out = fp8_kinds.main(["--parts", "train", "--rounds", "1", "--steps", "2", "--warmup", "1", "--hidden", "32",
                          "--batch-size", "8", "--no-pin"])["train"]
    assert len(out["timing"]["ratios"]) == 6 and all(math.isfinite(v) for v in out["final_loss"].values())
