"""Two CPU processes (gloo, launched once by torchrun): FSDP2 under ModelParallelStrategy and DDP comm dtypes.

The scenarios run in ``helpers/scale_out_worker.py`` (in the test run's one torchrun launch); each test reads
what both ranks saved.  References: torch's ShardedGradScaler driving the same sharded model (bit for bit), full-tensor
meters, an uninterrupted run, torch's own DDP compress hooks, byte counts written out by hand.
"""

from __future__ import annotations

import csv
import math

import pytest
import torch

from tests.lightning.helpers.scale_out_worker import BOOST_STEP, INF_STEP, STEPS

pytestmark = pytest.mark.multiprocess  # the torchrun launch: shares the xdist worker of process-launching tests


@pytest.fixture(scope="module")
def ranks(torchrun_out):
    """Every scenario on 2 processes; ``ranks(name)`` -> [rank 0's result, rank 1's result]."""
    out = torchrun_out(__name__)

    def load(name: str) -> list:
        return [torch.load(out / f"{name}_rank{r}.pt", weights_only=False) for r in (0, 1)]

    load.out = out
    return load


def _equal(a: dict, b: dict) -> bool:
    return sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_fsdp2_overflow_on_one_rank_skips_everywhere_like_sharded_grad_scaler(ranks):
    results = ranks("fsdp_skip")
    for r in results:
        assert r["skipped"] == r["overflows"] == 1
        ref = r["reference"]["steps"]  # ShardedGradScaler, same sharded model, data and injection
        for step, (ours, theirs) in enumerate(zip(r["steps"], ref)):
            assert _equal(ours["after"]["params"], theirs["params"]), step
            assert _equal(ours["after"]["states"], theirs["states"]), step
            assert ours["grad_norm"] == theirs["grad_norm"] or math.isinf(theirs["grad_norm"])
        skipped = r["steps"][INF_STEP]  # the inf was on rank 1's shard only: this rank changed nothing either
        assert _equal(skipped["after"]["params"], skipped["before"]["params"])
        assert _equal(skipped["after"]["states"], skipped["before"]["states"])
        # scales used per step vs ShardedGradScaler's scale after each step (256, growth interval 3, backoff 0.5)
        assert [s["scale"] for s in r["steps"]] == [256.0, 256.0, 256.0, 128.0, 128.0, 128.0]
        assert [s["scale"] for s in ref] == [256.0, 256.0, 128.0, 128.0, 128.0, 256.0]
        assert r["scale"] == ref[-1]["scale"]
    assert results[0]["scale"] == results[1]["scale"]


def test_overflow_consensus_is_one_all_reduce_of_one_value(ranks):
    for r in ranks("fsdp_skip"):
        # per step the scaler's check issues one all-reduce of one float32 flag (4 bytes), nothing else
        assert r["consensus"] == [[("all_reduce", 4)]] * STEPS


def test_fsdp2_monitor_logs_once_with_meters_reduced_over_ranks(ranks):
    results = ranks("fsdp_skip")
    for r in results:
        history = r["history"]
        assert [h["step"] for h in history] == list(range(1, STEPS + 1))
        for h, full in zip(history, r["steps"]):  # meters of the local shards, reduced = meters of full tensors
            if math.isinf(full["grad_norm"]):
                assert math.isinf(h["mp/grad_norm"])
                continue
            assert h["mp/grad_norm"] == pytest.approx(full["grad_norm"], rel=1e-6)
            lost, total = full["underflow"]
            assert h["mp/grad_underflow_frac"] == lost / total
    assert results[0]["history"] == results[1]["history"]  # every rank holds the same (reduced) numbers
    files = list((ranks.out / "logs").rglob("metrics.csv"))
    assert len(files) == 1  # one CSV, written by rank 0
    rows = list(csv.DictReader(files[0].open()))
    assert [int(row["step"]) for row in rows] == list(range(1, STEPS + 1))  # each step logged once


def test_fsdp2_bf16_master_bytes_per_param_per_rank(ranks):
    for r in ranks("fsdp_memory"):
        report = r["report"]
        assert report["n_shards"] == 2 and report["actual"] == report["estimate"]
        # one rank: FP32 param shard (the master) 4 + FP32 grad shard 4 + AdamW m, v 8, all halved
        # (the run reduces in bf16, comm_dtype="bfloat16": the gradient shards are FP32 all the same)
        assert report["actual"]["bytes_per_param"] == (4 + 4 + 8) / 2
        # no low-precision copy is held, no second master: the linears' FP32 shards are the masters, the
        # LayerNorm (kept FP32 by the policy) holds its FP32 shard as a weight
        params, norm = report["actual"]["params"], r["norm_numel"]
        assert report["actual"]["masters"] == 4 * (params - norm) / 2
        assert report["actual"]["weights"] == 4 * norm / 2
        assert r["param_types"] == ["DTensor"] and r["state_dtypes"] == ["torch.float32"]
        assert r["plugin_masters"] == 0
        # transient: the unit being computed is gathered in bf16 (2 B per parameter of that unit)
        assert r["gathered"] and all(g == (2 * r["unit_numel"], ["bfloat16"], ["Parameter"]) for g in r["gathered"])
        assert r["norm_gathered"] and all(g == ["out torch.float32", "torch.float32"] for g in r["norm_gathered"])


def test_fsdp2_resume_through_distributed_checkpoint_equals_uninterrupted(ranks):
    for r in ranks("fsdp_resume"):
        whole, resumed = r["whole"], r["resumed"]
        assert r["ckpt_files"] == [".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt"]  # one shard file per rank
        assert _equal(resumed["params"], whole["params"])
        assert _equal(resumed["states"], whole["states"])
        for key in ("scale", "skipped", "steps", "global_step"):
            assert resumed[key] == whole[key], key
        assert whole["skipped"] == 1 and whole["steps"] == 6
        assert resumed["losses"] == whole["losses"][3:]


def test_fsdp2_models_not_sharded_for_the_recipe_are_refused(ranks):
    for errors in ranks("fsdp_refused"):
        assert "net.0.weight is not sharded" in errors["unsharded_master"]
        assert "fsdp_policy" in errors["unsharded_master"]
        assert "no sharded form" in errors["kahan"] and "bf16-master" in errors["kahan"]
        assert "net.0.weight gathers in float32 and reduces in float32" in errors["wrong_policy"]
        assert "needs bfloat16 and float32" in errors["wrong_policy"]


def test_ddp_comm_dtype_counted_bytes_and_hooks(ranks):
    results = ranks("ddp_comm")
    for r in results:
        for comm, size in (("float32", 4), ("bfloat16", 2), ("float16", 2)):
            plain, counted = r[(comm, False, None)], r[(comm, True, None)]
            assert _equal(counted["params"], plain["params"])  # the counting hook reduces as torch's hooks do
            assert counted["by_dtype"] == {comm: counted["bytes"]}
            assert counted["bytes"] == 4 * counted["numel"] * size  # 4 steps x 161 elements x bytes in comm_dtype
        for comm in ("bfloat16", "float16"):  # low-precision communication stays close to FP32's
            assert r[(comm, False, None)]["losses"] == pytest.approx(r[("float32", False, None)]["losses"], rel=1e-3)
        for comm in ("float32", "bfloat16"):  # bf16-master: bf16 buckets, reduced in comm_dtype (FP32 by default)
            run = r[("bf16-master", comm)]
            assert run["by_dtype"] == {comm: 2 * run["numel"] * (4 if comm == "float32" else 2)}  # 2 steps
    for a, b in zip(*([v for k, v in r.items() if k[0] != "bf16-master"] for r in results)):
        assert _equal(a["params"], b["params"]) and a["skips"] == b["skips"]  # ranks agree everywhere
    for comm in ("float32", "bfloat16"):
        assert _equal(results[0][("bf16-master", comm)]["masters"], results[1][("bf16-master", comm)]["masters"])


def test_ddp_fp16_reduction_overflow_is_caught_after_the_reduction(ranks):
    for r in ranks("ddp_comm"):
        # rank 0's FP32 gradient x 1e6 at step 2: finite everywhere before the reduction
        fp16, fp32, bf16 = (r[(c, False, BOOST_STEP)] for c in ("float16", "float32", "bfloat16"))
        assert fp16["skips"] == [False, False, True, False]  # inf only after the fp16 all-reduce: both ranks skip
        assert fp16["scale"] == 128.0  # 256 backed off once
        assert all(torch.isfinite(p).all() for p in fp16["params"].values())
        assert not fp32["skips"][BOOST_STEP] and not bf16["skips"][BOOST_STEP]  # FP32's range: no overflow there
