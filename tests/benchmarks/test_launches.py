"""launches.py, the op and sync counter of issue 47: it counts exactly, and its reduced form runs (Trainer and
Fabric, two recipes, ours and native).  No assertion of ours against native here: the figures are the report's."""

from __future__ import annotations

import json

import launches
import pytest
import torch

from tests.benchmarks import TINY


def test_the_counter_counts_the_ops_and_scalar_reads_of_its_step_and_leaves_out_optimizer_step_reads():
    counter = launches.StepCounter(warmup=1)
    p = torch.nn.Parameter(torch.ones(4))
    opt = torch.optim.AdamW([p], lr=0.1, foreach=False)  # the single-tensor loop reads its step with .item()
    for _ in range(counter.total):
        counter.begin()
        loss = (p * 2).sum()
        loss.backward()
        if bool(torch.isfinite(loss)):  # one scalar read of a device tensor: a sync
            opt.step()
        opt.zero_grad()
        counter.end()
    out = counter.result()
    assert out["syncs"] == 1 and out["optimizer_step_reads"] >= 1
    assert out["by_op"]["_local_scalar_dense"] == 1  # the step's own read left out of the ops too
    assert out["by_op"]["mul"] == 3 and out["by_op"]["sum"] == 1 and out["by_op"]["lerp_"] == 1  # AdamW's m
    assert not any(name.startswith("profiler") for name in out["by_op"])  # record_function's markers
    assert 0 < out["kernels"] < out["ops"] == sum(out["by_op"].values())  # detach, expand: views
    before = sum(out["by_op"].values())
    (p * 3).sum()  # after the counted step: not counted
    assert sum(counter.result()["by_op"].values()) == before


def test_the_reduced_form_counts_ours_and_native(tmp_path, capsys):
    path = tmp_path / "launches.json"
    rows = launches.main(["--frameworks", "trainer", "fabric", "--models", "tiny", "--recipes", "bf16-mixed",
                          "bf16-master", "--optimizers", "foreach", "--warmup", "1", *TINY, "--json", str(path)])
    printed = capsys.readouterr().out
    assert len(rows) == 4 and json.loads(path.read_text())["rows"] == rows
    for r in rows:
        assert r["ours"].startswith("ours ") and r["native"].startswith("native ")
        assert f"| {r['ours']} | {r['native']} |" in printed
        for side in ("ours_counts", "native_counts"):
            c = r[side]
            assert all(isinstance(c[k], int) and c[k] >= 0 for k in ("ops", "kernels", "syncs"))
            assert c["ops"] > 0 and c["kernels"] > 0 and c["by_op"]
    assert {r["native"] for r in rows} == {"native bf16-mixed, AdamW(foreach=True)"}


@pytest.mark.slow
@pytest.mark.multiprocess
def test_keras_on_the_torch_backend_is_counted_in_a_subprocess():
    rows = launches.main(["--frameworks", "keras", "--models", "tiny", "--recipes", "16-mixed", "--warmup", "1",
                          *TINY])
    assert rows[0]["native"] == "native 16-mixed" and rows[0]["ours_counts"]["ops"] > 0
