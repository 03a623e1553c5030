"""The memory estimator against byte counts written out by hand (never against another call of itself).

Storage sizes come from the formats' bit widths (float32: 32 bits, float16 and bfloat16: 16 bits);
slot counts from what each optimizer keeps per parameter (Adam/AdamW: m and v; SGD with momentum:
one buffer; plain SGD: none), in FP32.
"""

from __future__ import annotations

import itertools

import pytest

from mp_callbacks import estimate_memory, get_recipe
from mp_callbacks.memory import MemoryEstimate, bytes_per_param, memory_report
from mp_callbacks.weights import MasterPlan

SIZE = {"float32": 32 // 8, "float16": 16 // 8, "bfloat16": 16 // 8}
SLOTS = {"adamw": 2, "adam": 2, "sgd-momentum": 1, "sgd": 0}
LOW = {"32-true": None, "16-mixed": None, "bf16-mixed": None, "16-master": "float16", "bf16-master": "bfloat16"}


def by_hand(recipe: str, optimizer: str, numel: int, fp32_master_grads: bool, released: bool) -> dict:
    """weights + grads + FP32 masters + FP32 slots, for ``numel`` parameters in the recipe's storage."""
    low = LOW[recipe]
    if low is None:  # FP32 parameters are their own masters
        weights, grads, masters = 4 * numel, 4 * numel, 0
    else:
        weights = 0 if released else SIZE[low] * numel
        grads = (4 if fp32_master_grads else SIZE[low]) * numel
        masters = 4 * numel
    return {"params": numel, "weights": weights, "grads": grads, "masters": masters,
            "optimizer_state": 4 * SLOTS[optimizer] * numel}


CASES = [(r, o, g, rel) for r, o, g, rel in itertools.product(LOW, SLOTS, (False, True), (False, True))
         if g or not rel]


@pytest.mark.parametrize("recipe, optimizer, fp32_master_grads, released", CASES)
def test_estimate_counts_each_part(recipe, optimizer, fp32_master_grads, released):
    est = estimate_memory(get_recipe(recipe).master, optimizer, 1000, fp32_master_grads=fp32_master_grads,
                          weights_released=released)
    want = by_hand(recipe, optimizer, 1000, fp32_master_grads, released)
    assert {k: getattr(est, k) for k in want} == want
    assert est.total == sum(v for k, v in want.items() if k != "params")
    assert est.bytes_per_param == est.total / 1000


def test_the_source_documents_figures():
    """AdamW under bf16-master: 2 + 2 + 4 + 4 + 4 = 16 B/param; 18 with FP32 grads on the masters;
    16 again with the bf16 weights released during the step (4 + 4 + 4 + 4); FP32 recipes 16."""
    plan = get_recipe("bf16-master").master
    assert bytes_per_param(plan, "adamw") == 2 + 2 + 4 + 4 + 4
    assert bytes_per_param(plan, "adamw", fp32_master_grads=True) == 2 + 4 + 4 + 4 + 4
    assert bytes_per_param(plan, "adamw", fp32_master_grads=True, weights_released=True) == 0 + 4 + 4 + 4 + 4
    assert bytes_per_param(get_recipe("32-true").master, "adamw") == 4 + 4 + 4 + 4
    assert bytes_per_param(get_recipe("16-master").master, "sgd") == 2 + 2 + 4
    with pytest.raises(ValueError, match="weights_released=True describes the optimizer step"):
        bytes_per_param(plan, "adamw", weights_released=True)


def test_fp32_kept_parameters_need_no_master_and_keep_their_weights():
    plan = get_recipe("bf16-master").master
    est = estimate_memory(plan, "adamw", [(100, "bfloat16"), (30, "float32")], fp32_master_grads=True,
                          weights_released=True)
    # bf16: weight released, FP32 grad, master, m, v; FP32-kept: weight, grad, m, v (no master)
    assert (est.params, est.weights, est.grads, est.masters, est.optimizer_state) == (
        130, 0 + 30 * 4, 100 * 4 + 30 * 4, 100 * 4, 130 * 8)


def test_memory_report_sums_optimizers_and_refuses_unknown_ones():
    plan = get_recipe("16-master").master
    actual = MemoryEstimate(params=70, weights=1, grads=2, masters=3, optimizer_state=4)
    report = memory_report("16-master", plan, [("AdamW", 0.0, [(50, "float16")]),
                                               ("SGD", 0.9, [(20, "float32")])], actual, weights_released=False)
    assert report["optimizers"] == ["adamw", "sgd-momentum"]
    assert report["actual"] == {"params": 70, "weights": 1, "grads": 2, "masters": 3, "optimizer_state": 4,
                                "compensation": 0, "total": 10, "bytes_per_param": 10 / 70}
    # at the step: fp16 weights kept (2), FP32 grads on the masters (4), masters (4), Adam m, v (8);
    # FP32 params under SGD with momentum: weight, grad, buffer
    weights, grads, masters, state = 50 * 2 + 20 * 4, 50 * 4 + 20 * 4, 50 * 4, 50 * 8 + 20 * 4
    total = weights + grads + masters + state
    assert report["estimate"] == {"params": 70, "weights": weights, "grads": grads, "masters": masters,
                                  "optimizer_state": state, "compensation": 0, "total": total,
                                  "bytes_per_param": total / 70}
    unknown = memory_report("16-master", plan, [("Shampoo", 0.0, [(50, "float16")])], actual)
    assert unknown["estimate"] is None and unknown["optimizers"] == ["shampoo (unknown to the core)"]


def test_master_plan_refuses_fp32_masters_of_fp32_params():
    with pytest.raises(ValueError, match="needs a low-precision param_dtype"):
        MasterPlan(master_weights=True)
