"""The loss scaler's CUDA path gives the CPU reference's scale trajectory, step for step.

On CUDA, :class:`lightning_ext.TorchLossScaler` checks and unscales with torch's fused
``_amp_foreach_non_finite_check_and_unscale_`` and moves its state by the core's ``next_state``
evaluated on 0-d device tensors; torch's ``GradScaler("cuda")`` moves its scale with the fused
``_amp_update_scale_``.  Both, fed the same gradients with injected infs, must give the scales of
the core's NumPy reference (``next_state`` with ``NUMPY_OPS``) replayed on the overflow flags.

CPU counterparts: tests/lightning/test_torch_scaler.py, tests/core/test_anchors.py.
"""

from __future__ import annotations

import random

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from lightning_ext import MixedPrecision, TorchLossScaler
from mp_callbacks import NUMPY_OPS, ScalerConfig, initial_state, next_state
from tests.cuda.helpers import DEVICE, ON_CUDA, Net, cuda_only, fit

pytestmark = cuda_only

STEPS = 200
rng = random.Random(0)
INF_STEPS = {t for t in range(STEPS) if rng.random() < 0.25} | set(range(60, 67))  # and one long run


@pytest.fixture
def kernel_calls(monkeypatch):
    """Counts torch's fused AMP kernels, with the device type of their first tensor."""
    calls: list[tuple[str, str]] = []
    for name in ("_amp_foreach_non_finite_check_and_unscale_", "_amp_update_scale_"):
        original = getattr(torch, name)

        def counting(*args, _name=name, _original=original, **kwargs):
            first = args[0][0] if isinstance(args[0], (list, tuple)) else args[0]
            calls.append((_name, first.device.type))
            return _original(*args, **kwargs)

        monkeypatch.setattr(torch, name, counting)
    return calls


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)).to(DEVICE)


def _run(scaler, model) -> tuple[list[float], list[bool]]:
    """``STEPS`` steps of AdamW through ``scaler``'s GradScaler protocol: the scale after each step,
    and whether each step overflowed (read from the scaler's counters)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    scales, overflowed = [], []
    for step in range(STEPS):
        x, y = torch.randn(8, 16, generator=g).to(DEVICE), torch.randn(8, 1, generator=g).to(DEVICE)
        loss = nn.functional.mse_loss(model(x), y)
        if step in INF_STEPS:
            loss = loss * float("inf")
        opt.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(opt)
        before = scaler.get_scale()
        scaler.update()
        scales.append(scaler.get_scale())
        overflowed.append(bool(scaler.latest()["overflow"].item()) if isinstance(scaler, TorchLossScaler)
                          else scales[-1] < before)
    return scales, overflowed


def _reference(config: ScalerConfig, overflowed: list[bool]) -> tuple[list[float], object]:
    state = initial_state(config, NUMPY_OPS)
    scales = []
    for flag in overflowed:
        state, _ = next_state(config, state, flag, NUMPY_OPS)
        scales.append(float(state.scale))
    return scales, state


def test_torch_preset_on_cuda_matches_the_reference_and_torchs_fused_update(kernel_calls):
    config = ScalerConfig.preset("torch", init_scale=2.0**8, growth_interval=3)
    ours = TorchLossScaler(config, divergence=False)  # 7 inf losses in a row would stop the run
    scales, overflowed = _run(ours, _model())
    assert {t for t, o in enumerate(overflowed) if o} >= INF_STEPS  # every injected inf was seen
    ref_scales, ref = _reference(config, overflowed)
    assert scales == ref_scales
    assert (ours.steps, ours.overflows, ours.skipped, ours.growths) == (
        int(ref.steps), int(ref.overflows), int(ref.skipped), int(ref.growths))
    assert ours.state.scale.device.type == DEVICE
    checks = [d for n, d in kernel_calls if n == "_amp_foreach_non_finite_check_and_unscale_"]
    assert len(checks) == STEPS and set(checks) == {DEVICE}
    assert not [n for n, _ in kernel_calls if n == "_amp_update_scale_"]  # ours: the core's transition
    kernel_calls.clear()
    native = torch.amp.GradScaler(DEVICE, init_scale=2.0**8, growth_interval=3)
    native_scales, _ = _run(native, _model())
    assert native_scales == scales  # torch's fused _amp_update_scale_ gives the same trajectory
    if ON_CUDA:
        assert [d for n, d in kernel_calls if n == "_amp_update_scale_"] == ["cuda"] * STEPS


@pytest.mark.parametrize("preset", ["megatron", "deepspeed", "keras"])
def test_hysteresis_and_other_presets_on_cuda_match_the_reference(preset):
    overrides = {"init_scale": 2.0**8, "growth_interval": 3}
    if preset == "deepspeed":
        overrides["on_min_scale"] = "clamp"
    config = ScalerConfig.preset(preset, **overrides)
    ours = TorchLossScaler(config, divergence=False)  # 7 inf losses in a row would stop the run
    scales, overflowed = _run(ours, _model())
    assert {t for t, o in enumerate(overflowed) if o} >= INF_STEPS
    ref_scales, ref = _reference(config, overflowed)
    assert scales == ref_scales
    assert (ours.steps, ours.overflows, ours.skipped, ours.growths) == (
        int(ref.steps), int(ref.overflows), int(ref.skipped), int(ref.growths))


class _Scales(pl.Callback):
    def __init__(self) -> None:
        self.scales: list[float] = []
        self.overflow: list[bool] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        latest = trainer.precision_plugin.latest_stats()
        self.scales.append(float(latest["next_scale"].item()))
        self.overflow.append(bool(latest["overflow"].item()))


@pytest.mark.parametrize("recipe", ["16-mixed", "16-master"])
def test_the_plugins_scale_on_cuda_follows_the_reference(recipe):
    inf_steps = {1, 2, 3, 9, 10, 17}
    scaler = {"init_scale": 2.0**10, "growth_interval": 2}
    probe = _Scales()
    plugin = MixedPrecision(recipe, device=DEVICE, scaler=scaler)
    fit(plugin, Net(inf_steps=inf_steps), steps=24, callbacks=[probe])
    assert {t for t, o in enumerate(probe.overflow) if o} >= inf_steps
    ref_scales, ref = _reference(plugin.recipe.scaler, probe.overflow)
    assert probe.scales == ref_scales
    assert plugin.scaler.state.scale.device.type == DEVICE
    assert (plugin.scaler.skipped, plugin.scaler.growths) == (int(ref.skipped), int(ref.growths))
