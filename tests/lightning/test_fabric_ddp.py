"""Two CPU processes (gloo, launched once by torchrun): lightning_ext.fabric.MixedPrecision under Fabric's
DDPStrategy and ModelParallelStrategy (FSDP2).

The scenarios run in ``helpers/fabric_worker.py`` (in the test run's one torchrun launch); each test reads
what both ranks saved.
"""

from __future__ import annotations

import pytest
import torch

from tests.lightning.helpers.fabric_worker import INF_STEP, STEPS

pytestmark = pytest.mark.multiprocess  # the torchrun launch: shares the xdist worker of process-launching tests


@pytest.fixture(scope="module")
def ranks(torchrun_out):
    """Every scenario on 2 processes; ``ranks(name)`` -> [rank 0's result, rank 1's]."""
    out = torchrun_out(__name__)
    return lambda name: [torch.load(out / f"{name}_rank{r}.pt", weights_only=False) for r in (0, 1)]


def _equal(a: dict, b: dict) -> bool:
    return sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_ddp_overflow_on_one_rank_skips_on_both(ranks):
    r0, r1 = ranks("ddp_skip")
    for r in (r0, r1):
        assert r["skipped"] == r["overflows"] == 1 and r["weight_dtype"] == "torch.float16"
        assert [s["skipped"] for s in r["steps"]] == [step == INF_STEP for step in range(STEPS)]
        skipped = r["steps"][INF_STEP]  # rank 0's gradients were finite: it changed nothing either
        for part in ("params", "masters", "states"):
            assert _equal(skipped["before"][part], skipped["after"][part]), part
        assert r["scale"] == 2.0**7 and all(torch.isfinite(torch.tensor(r["losses"])))
        assert list(r["comm"]) == ["float32"] and r["comm"]["float32"] > 0  # the recipe's hook: FP32 reduction
    for part in ("params", "masters", "states"):  # the ranks stay equal, step after step
        assert all(_equal(a["after"][part], b["after"][part]) for a, b in zip(r0["steps"], r1["steps"])), part


def test_ddp_save_load_resume_is_exact(ranks):
    for r in ranks("ddp_resume"):
        for part in ("params", "masters", "states"):
            assert _equal(r["whole"][part], r["resumed"][part]), part


def test_fsdp2_bf16_master_trains_and_skips_together(ranks):
    r0, r1 = ranks("fsdp_skip")
    for r in (r0, r1):
        assert r["sharded"] == 2 and r["masters"] == 0  # the FP32 shards are the masters
        assert r["param_types"] == ["DTensor torch.float32"]
        assert r["skipped"] == 1 and [s["skipped"] for s in r["steps"]] == [step == INF_STEP for step in range(STEPS)]
        skipped = r["steps"][INF_STEP]  # the inf was on rank 1's shard only
        assert _equal(skipped["before"]["params"], skipped["after"]["params"])
        assert _equal(skipped["before"]["states"], skipped["after"]["states"])
        assert all(v.dtype == torch.float32 for v in r["steps"][-1]["after"]["states"].values())
        assert torch.isfinite(torch.tensor(r["losses"])).all()
        assert all(not _equal(s["before"]["params"], s["after"]["params"]) for s in r["steps"] if not s["skipped"])
    assert _equal(r0["full"], r1["full"])
    # the monitor (attached by hand after setup_module): meters of the local shards reduced over the ranks
    assert r0["history"] == r1["history"]
    assert [h[:3] for h in r0["history"]] == [(s + 1, s == INF_STEP, int(s >= INF_STEP)) for s in range(STEPS)]
    assert all(h[3] > 0 for h in r0["history"] if not h[1])
