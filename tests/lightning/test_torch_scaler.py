"""TorchLossScaler speaks torch GradScaler's protocol and matches it step for step."""

import copy
import inspect
import warnings

import pytest
import torch
from torch import nn

from lightning_ext import MasterWeights, MixedPrecision, OptState, TorchLossScaler
from mp_callbacks.loss_scale import ScalerConfig
from mp_callbacks.settings import StateDictError

INF_STEPS = {2, 3, 9}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 12), nn.ReLU(), nn.Linear(12, 1))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(8, 6, generator=g), torch.randn(8, 1, generator=g)


def _run(scaler, model, opt, steps=12, clip=False):
    scales = []
    for step in range(steps):
        x, y = _batch(step)
        loss = nn.functional.mse_loss(model(x), y)
        if step in INF_STEPS:
            loss = loss * float("inf")
        opt.zero_grad()
        scaler.scale(loss).backward()
        if clip:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    return scales


@pytest.mark.parametrize("clip", [False, True])
def test_grad_scaler_protocol_matches_torch_bit_for_bit(clip):
    native_model, ours_model = _model(), _model()
    native_opt = torch.optim.AdamW(native_model.parameters(), lr=1e-2)
    ours_opt = torch.optim.AdamW(ours_model.parameters(), lr=1e-2)
    native = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=3)
    ours = TorchLossScaler(ScalerConfig.preset("torch", init_scale=2.0**8, growth_interval=3))
    assert _run(ours, ours_model, ours_opt, clip=clip) == _run(native, native_model, native_opt, clip=clip)
    for a, b in zip(ours_model.parameters(), native_model.parameters(), strict=True):
        assert torch.equal(a, b)
    assert (ours.steps, ours.skipped, ours.overflows) == (12, len(INF_STEPS), len(INF_STEPS))
    for name in ("growth_factor", "backoff_factor", "growth_interval"):
        assert getattr(ours, f"get_{name}")() == getattr(native, f"get_{name}")()


def test_stage_errors_are_torchs():
    model, scaler = _model(), TorchLossScaler(ScalerConfig.preset("torch"))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = _batch(0)
    scaler.scale(nn.functional.mse_loss(model(x), y)).backward()
    scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match="already been called on this optimizer"):
        scaler.unscale_(opt)
    scaler.step(opt)
    with pytest.raises(RuntimeError, match="after step"):
        scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match="already been called"):
        scaler.step(opt)
    with pytest.raises(RuntimeError, match="Closure"):
        scaler.step(opt, closure=lambda: None)
    scaler.update()
    assert scaler._stages == {} and scaler.steps == 1  # the cycle starts again


def test_update_with_new_scale_and_setters():
    scaler = TorchLossScaler(ScalerConfig.preset("torch"))
    scaler.update(new_scale=128.0)
    assert scaler.get_scale() == 128.0 and scaler.steps == 0
    scaler.set_growth_factor(4.0)
    scaler.set_backoff_factor(0.25)
    scaler.set_growth_interval(7)
    assert (scaler.get_growth_factor(), scaler.get_backoff_factor(), scaler.get_growth_interval()) == (4.0, 0.25, 7)
    with pytest.raises(ValueError, match="growth_factor"):
        scaler.set_growth_factor(0.5)


def test_state_dict_round_trip_and_mismatch():
    a = TorchLossScaler(ScalerConfig.preset("torch", init_scale=2.0**4))
    model = _model()
    _run(a, model, torch.optim.SGD(model.parameters(), lr=0.01), steps=5)
    b = TorchLossScaler(ScalerConfig.preset("torch", init_scale=2.0**4))
    b.load_state_dict(a.state_dict())
    assert b.state_dict() == a.state_dict() and b.skipped == a.skipped == 2
    with pytest.raises(StateDictError, match="different config"):
        TorchLossScaler(ScalerConfig.preset("megatron")).load_state_dict(a.state_dict())


def test_disabled_scaler_never_skips_and_scale_is_identity():
    scaler = TorchLossScaler(ScalerConfig.preset("torch", enabled=False))
    loss = torch.tensor(3.0)
    assert scaler.scale(loss) is loss and not scaler.is_enabled() and scaler.get_scale() == 1.0


def test_scale_takes_iterables():
    scaler = TorchLossScaler(ScalerConfig.preset("torch", init_scale=4.0))
    out = scaler.scale([torch.tensor(1.0), (torch.tensor(2.0),)])
    assert float(out[0]) == 4.0 and float(out[1][0]) == 8.0
    with pytest.raises(TypeError, match="tensor or an iterable"):
        scaler.scale(3.0)


def test_masters_collect_unscale_and_step_in_the_plugins_order():
    """Under *-master the plugin moves grads to the FP32 masters, the scaler unscales them there, the store steps
    the masters and rounds them back."""
    model = _model().to(torch.bfloat16)
    fp32 = {n: p.detach().float() for n, p in model.named_parameters()}
    masters = MasterWeights()
    masters.record_originals(model, fp32)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    masters.install(model, [opt])
    scaler = TorchLossScaler(ScalerConfig.preset("torch", init_scale=2.0**4))
    ref = copy.deepcopy(fp32)
    x, y = _batch(0)
    scaler.scale(nn.functional.mse_loss(model(x.bfloat16()).float(), y)).backward()
    grads = {e.name: e.low.grad.float() / 16 for e in masters.entries()}
    masters.collect_grads(opt)
    scaler.unscale_(opt)
    assert not scaler.skips(opt)
    masters.step(opt)
    scaler.update()
    for entry in masters.entries():
        expected = ref[entry.name] - 0.1 * grads[entry.name]
        assert torch.equal(entry.master.detach(), expected), entry.name
        assert torch.equal(entry.low.detach(), expected.to(torch.bfloat16)), entry.name
        assert entry.master.grad is None  # spent FP32 grads are dropped after the step


def test_plugin_scaler_is_none_without_loss_scaling():
    for recipe in ("bf16-mixed", "bf16-master", "32-true"):
        plugin = MixedPrecision(recipe)
        assert plugin.scaler is None and plugin.loss_scaler is not None
    scaled = MixedPrecision("16-mixed")
    assert isinstance(scaled.scaler, TorchLossScaler) and scaled.scaler.is_enabled()
    assert OptState.READY.value == 0


@pytest.mark.parametrize("config", [
    ScalerConfig(enabled=False), ScalerConfig(enabled=False, skip_nonfinite=False),
    ScalerConfig.preset("torch", init_scale=2.0**8, growth_interval=3),
    ScalerConfig(init_scale=4.0, min_scale=1.0, max_scale=16.0, growth_interval=2, hysteresis=2,
                 consecutive_hysteresis=True),
    ScalerConfig(dynamic=False, init_scale=8.0)], ids=["skip", "count", "torch", "hysteresis", "fixed"])
def test_the_device_state_equals_the_reference_step_by_step(config):
    # The device state, latest(), the counters and the scale the next backward runs with (and the unscaled
    # gradients) must equal the NumPy reference replayed on the same flags, as device tensors of the same dtypes.
    from mp_callbacks import NUMPY_OPS, initial_state, next_state

    scaler = TorchLossScaler(config, count_overflows=True)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    ref = initial_state(config, NUMPY_OPS)
    for step in range(12):
        x, y = _batch(step)
        loss = nn.functional.mse_loss(model(x), y) * (float("inf") if step in INF_STEPS else 1.0)
        opt.zero_grad()
        scaled = scaler.scale(loss)
        assert scaled.item() == loss.item() * float(ref.scale) or not torch.isfinite(loss)
        scaled.backward()
        raw = [p.grad.clone() for p in model.parameters()]
        flag = not all(torch.isfinite(g).all() for g in raw)  # applied infs poison later steps
        scaler.unscale_(opt)
        inv = torch.tensor(float(ref.scale), dtype=torch.float64).reciprocal().float()
        for g, p in zip(raw, model.parameters(), strict=True):  # GradScaler's unscale: g * float32(1 / scale)
            assert torch.equal(p.grad, g * inv) or flag
        scaler.step(opt)
        scaler.update()
        ref, applied = next_state(config, ref, flag, NUMPY_OPS)
        assert scaler.get_scale() == float(ref.scale)
        state = scaler.state
        assert state.scale.dtype == torch.float32 and state.steps.dtype == torch.int32
        for name, value in zip(state._fields, state):
            assert value.item() == getattr(ref, name).item(), (step, name)
        latest = scaler.latest()
        assert bool(latest["overflow"]) is flag
        assert bool(latest["applied"]) is bool(applied)
        assert latest["skipped_total"].item() == ref.skipped.item()
        assert scaler.skipped == int(ref.skipped) and scaler.overflows == int(ref.overflows)
    assert scaler.skipped == (len(INF_STEPS) if config.can_skip else 0)


def test_the_opt_out_looks_at_nothing(monkeypatch):
    # scaler={"enabled": False, "skip_nonfinite": False}, no count: nothing is checked, the step's overflow flag
    # is 0 and the state moves as the reference on False flags; an inf step is applied and not counted.
    from mp_callbacks import NUMPY_OPS, initial_state, next_state

    config = ScalerConfig(enabled=False, skip_nonfinite=False)
    scaler = TorchLossScaler(config, count_overflows=False)
    assert not scaler.checks_overflow
    monkeypatch.setattr(torch, "_amp_foreach_non_finite_check_and_unscale_", lambda *a: pytest.fail("a check"))
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    ref = initial_state(config, NUMPY_OPS)
    for step in range(6):
        x, y = _batch(step)
        opt.zero_grad()
        scaler.scale(nn.functional.mse_loss(model(x), y) * (float("inf") if step in INF_STEPS else 1.0)).backward()
        assert scaler.unscale_(opt).item() == 0.0
        scaler.step(opt)
        scaler.update()
        ref, _ = next_state(config, ref, False, NUMPY_OPS)
        for name, value in zip(scaler.state._fields, scaler.state):
            assert value.item() == getattr(ref, name).item(), (step, name)
    assert (scaler.steps, scaler.overflows, scaler.skipped) == (6, 0, 0)


@pytest.mark.parametrize("config", [ScalerConfig(enabled=False), ScalerConfig(enabled=False, skip_nonfinite=False),
                                    ScalerConfig.preset("torch", init_scale=2.0**8)], ids=["skip", "count", "torch"])
def test_the_decision_is_one_host_read_at_most(config, monkeypatch):
    # As GradScaler.step: one read of found_inf where the step can be skipped, none where it cannot; a skipped
    # step adds the divergence rule's one read (its loss flag, scale and step number).
    scaler = TorchLossScaler(config, count_overflows=True)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    reads = []
    item, tolist = torch.Tensor.item, torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "item", lambda t: (reads.append("item"), item(t))[1])
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: (reads.append("tolist"), tolist(t))[1])
    for step in range(6):
        x, y = _batch(step)
        opt.zero_grad()
        scaler.scale(nn.functional.mse_loss(model(x), y) * (float("inf") if step in INF_STEPS else 1.0)).backward()
        reads.clear()
        scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
        skipped = scaler.last_step_skipped(opt)
        if not config.can_skip:
            assert reads == [] and not skipped
        else:
            assert reads == (["item", "tolist"] if skipped else ["item"]), step
    assert scaler.skipped == (2 if config.can_skip else 0)


def test_host_transition_floor_hit_warns_at_the_callers_line():
    # Scaling on, decisions on the host: a floor hit still reacts per on_min_scale, the warning pointing at
    # the caller of update() as the device transition's did.
    from mp_callbacks.loss_scale import ScaleFloorWarning

    scaler = TorchLossScaler(ScalerConfig(init_scale=2.0, min_scale=1.0, on_min_scale="warn"))
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    hits = []

    def optimizer_step() -> None:  # the plugin's depth: its optimizer_step calls update()
        scaler.update()
    for step in range(3):
        x, y = _batch(step)
        opt.zero_grad()
        scaler.scale(nn.functional.mse_loss(model(x), y) * float("inf")).backward()
        scaler.step(opt)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            line = inspect.currentframe().f_lineno + 1
            optimizer_step()
        hits += [w for w in caught if issubclass(w.category, ScaleFloorWarning)]
    assert [(w.filename, w.lineno) for w in hits] == [(__file__, line)] * 2  # steps 2, 3 hit the floor of 1
    assert "scale=1" in str(hits[0].message) and scaler.get_scale() == 1.0
