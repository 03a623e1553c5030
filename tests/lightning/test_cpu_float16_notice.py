"""Lightning: a float16 recipe on a CPU without native float16 matmuls warns once at setup (the core decides:
:func:`mp_callbacks.advice.cpu_float16_notice`); bfloat16 recipes and CUDA devices do not."""

from __future__ import annotations

import warnings

import pytest
import torch
from lightning.fabric import Fabric

import lightning_ext.fabric
import lightning_ext.setup as recipe_setup  # the module that asks cpu_flags
from mp_callbacks.advice import FLOAT16_CPU_FEATURES, cpu_float16_notice
from tests.lightning.test_fabric import tiny, train

NO_FP16 = {"avx2", "f16c", "fma"}  # the CPU of the measurement (AMD EPYC): no AMX-FP16, no AVX512-FP16


def _notices(recipe: str, monkeypatch, flags=frozenset(NO_FP16), steps: int = 2) -> list[str]:
    monkeypatch.setattr(recipe_setup, "cpu_flags", lambda: set(flags))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plugin = lightning_ext.fabric.MixedPrecision(recipe)
        fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
        model = tiny()
        model, opt = fabric.setup(model, torch.optim.Adam(model.parameters(), lr=1e-2))
        train(fabric, model, opt, range(steps))
        fabric.setup_module(tiny())  # a second setup: still said once
    return [str(w.message) for w in caught if "computes in float16 on a CPU" in str(w.message)]


@pytest.mark.parametrize("recipe", ["16-mixed", "16-master"])
def test_float16_on_cpu_warns_once_with_the_cause(recipe, monkeypatch):
    notices = _notices(recipe, monkeypatch)
    assert notices == [f"lightning_ext.MixedPrecision: {cpu_float16_notice(recipe, 'float16', 'cpu', NO_FP16)}"]
    assert "AMX-FP16" in notices[0] and "bf16-mixed" in notices[0] and "x float32's" in notices[0]


@pytest.mark.parametrize("recipe", ["bf16-mixed", "32-true"])
def test_other_recipes_do_not_warn(recipe, monkeypatch):
    assert _notices(recipe, monkeypatch) == []


@pytest.mark.parametrize("feature", FLOAT16_CPU_FEATURES)
def test_a_cpu_with_native_float16_does_not_warn(feature, monkeypatch):
    assert _notices("16-mixed", monkeypatch, NO_FP16 | {feature}) == []


def test_the_core_rule():
    assert cpu_float16_notice("16-mixed", "float16", "cuda", NO_FP16) is None  # CUDA: no notice
    assert cpu_float16_notice("16-mixed", "float16", "cpu", set()) is None  # flags unknown: nothing to say
    assert cpu_float16_notice("bf16-mixed", "bfloat16", "cpu", NO_FP16) is None
    assert cpu_float16_notice("16-mixed", "float16", "cpu", NO_FP16) is not None
