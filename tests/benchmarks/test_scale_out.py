"""scale_out.py: bytes on the wire per recipe and comm_dtype, on 2 gloo processes (DDP) and 2 TF workers."""

from __future__ import annotations

import pytest
import scale_out

# Process launches (torchrun, TF workers) take 30-60 s here: outside `make test` (`pytest -m slow` runs them).
pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

QUICK = ["--steps", "3", "--hidden", "16", "--batch-size", "8", "--comms", "float32", "bfloat16"]


def test_ddp_bytes_follow_the_comm_dtype():
    rows = scale_out.main(["--parts", "ddp", "--recipes", "bf16-mixed", *QUICK])
    by = {(r["run"], r["comm_dtype"]): r for r in rows}
    fp32 = by[("ours bf16-mixed", "float32")]["bytes"]["all_reduce"]
    bf16 = by[("ours bf16-mixed", "bfloat16")]["bytes"]["all_reduce"]
    native = by[("native bf16-mixed", "float32")]["bytes"]["all_reduce"]
    grads = native["float32"]  # native: the FP32 gradients, all-reduced as they are
    assert grads > 0 and fp32["float32"] >= grads and bf16["bfloat16"] == grads // 2
    assert by[("ours bf16-mixed", "bfloat16")]["max_loss_diff"] is not None


def test_keras_multi_worker():
    rows = scale_out.main(["--parts", "keras", "--recipes", "bf16-mixed", *QUICK])
    by = {(r["run"], r["comm_dtype"]): r for r in rows}
    assert by[("ours bf16-mixed", "bfloat16")]["bytes"]["all_reduce"]["bfloat16"] > 0
