"""``MixedPrecision("fp8-mixed")``: FP8 matmuls against the core's NumPy model, the scaling states against
the core transition, the skip of a non-finite amax, FP32 regions, masters, attention, checkpoints.

* One FP8 matmul (``lightning_ext.fp8``): output and the three gradients equal the NumPy model
  (:func:`mp_callbacks.fp8.recipe.fp8_linear_reference`) with the same scales, within float32
  matmul rounding (different summation order); the FP8 operands themselves bit for bit.
* Training: after every step the states equal the core's NumPy transition replayed on the amaxes
  the step recorded (bit for bit); the scale a step quantizes with is the state of the step before
  (delayed) or of this amax (current).
* A step with an inf input: its amax is not finite, the step is skipped through the plugin's skip
  path (parameters, masters, optimizer state unchanged), no history takes the inf.
"""

from __future__ import annotations

import itertools

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_ext import MixedPrecision
from lightning_ext.fp8 import TorchFP8, fp8_modules
from lightning_ext.fp8.attention import mha_forward
from lightning_ext.fp8.matmul import fp8_linear
from mp_callbacks.fp8 import (
    FP8_ROLES,
    FP8Recipe,
    FP8State,
    fp8_amax,
    fp8_linear_reference,
    fp8_qdq,
    next_fp8_state,
    select_fp8_state,
)
from mp_callbacks.recipes import get_recipe
from tests.lightning.helpers.models import loader, trainer_kwargs

f32 = np.float32


class Net(pl.LightningModule):
    """Linear -> LayerNorm -> tanh -> Linear -> tanh -> head; ``bad_steps``: an inf in that step's input."""

    def __init__(self, bad_steps=(), hidden: int = 16, seed: int = 0, mha: bool = False) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.net = nn.Sequential(nn.Linear(8, hidden), nn.LayerNorm(hidden), nn.Tanh(), nn.Linear(hidden, hidden),
                                 nn.Tanh(), nn.Linear(hidden, 1))
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True) if mha else None
        self.bad_steps = set(bad_steps)
        self.seen: list[dict] = []

    def forward(self, x):
        if self.attn is not None:
            t = x.reshape(x.shape[0], 1, 8).expand(-1, 3, -1)
            x = x + self.attn(t, t, t, need_weights=False)[0].mean(1)
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.trainer.global_step in self.bad_steps:
            x = x.clone()
            x[0, 0] = float("inf")
        return F.mse_loss(self(x).float(), y)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        fp8 = self.trainer.precision_plugin.fp8
        self.seen.append({"amax": {r: fp8.latest["amax"][r].clone() for r in FP8_ROLES},
                          "used": {r: fp8.latest["used"][r].clone() for r in FP8_ROLES},
                          "applied": fp8.latest["applied"],
                          "states": {r: FP8State(*(t.clone() for t in fp8.states[r])) for r in FP8_ROLES}})

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def fit(plugin, model, steps=6):
    trainer = pl.Trainer(plugins=[plugin], max_steps=steps, **trainer_kwargs())
    trainer.fit(model, loader())
    return trainer


def numpy_states(state: FP8State):
    return FP8State(*(np.asarray(t.numpy()) for t in state))


def same(a, b):
    return np.array_equal(np.asarray(a), np.asarray(b))


# -- one FP8 matmul ----------------------------------------------------------------------------


@pytest.mark.parametrize("preset", ["transformer-engine", "keras"])
def test_one_fp8_matmul_matches_the_numpy_model(preset):
    recipe = FP8Recipe(preset, (("history_len", 4),))
    fp8 = TorchFP8(recipe)
    linear = nn.Linear(6, 5)
    torch.manual_seed(1)
    fp8.install(nn.Sequential(linear), get_recipe("fp8-mixed").policy)
    fp8._ensure(torch.device("cpu"))
    scales = {"inputs": 96.5, "weights": 310.0, "grad_outputs": 2.0**12 * 1.3}
    for role, scale in scales.items():  # committed states with non-trivial scales
        s = fp8.states[role]
        fp8.states[role] = s._replace(scale=torch.full_like(s.scale, scale),
                                      scale_inv=torch.full_like(s.scale, 1.0) / torch.full_like(s.scale, scale))
    x = (torch.randn(2, 3, 6) * 2).requires_grad_()
    dy = torch.randn(2, 3, 5) * 1e-3
    y = linear(x)
    y.backward(dy)
    with torch.no_grad():
        ref = fp8_linear_reference(
            x.detach().numpy(), linear.weight.detach().numpy(), linear.bias.detach().numpy(), dy.numpy(), recipe,
            {r: (f32(fp8.states[r].scale[0]), f32(fp8.states[r].scale_inv[0])) for r in FP8_ROLES})
    for name, got in (("y", y), ("dx", x.grad), ("dw", linear.weight.grad), ("db", linear.bias.grad)):
        want = ref[name]
        np.testing.assert_allclose(got.detach().numpy(), want, rtol=2e-6, atol=2e-6 * np.abs(want).max(),
                                   err_msg=name)
    assert torch.equal(linear.bias.grad, dy.reshape(-1, 5).sum(0))  # the bias gradient is not quantized
    for role in FP8_ROLES:  # the recorded amaxes are the tensors', exactly
        assert fp8._amax[role][0].item() == ref["amax"][role]
    # The FP8 operands: the same values as the core's quantize-dequantize, bit for bit.
    q, inv = fp8.quantize("inputs", 0, x.detach(), record=False)
    want = fp8_qdq(x.detach().numpy(), recipe.config("inputs"), f32(fp8.states["inputs"].scale[0]),
                   f32(fp8.states["inputs"].scale_inv[0]))
    assert same((q.float() * inv).numpy(), want)


def test_saturation_and_nan_in_the_cast():
    fp8 = TorchFP8(FP8Recipe())
    x = torch.tensor([1e6, -1e6, float("inf"), 1e-9, 3.0, float("nan")])
    fp8._add("t")
    q, inv = fp8.quantize("inputs", 0, x, record=False)
    got = (q.float() * inv).numpy()
    assert got[:4].tolist() == [448.0, -448.0, 448.0, 0.0] and got[4] == 3.0 and np.isnan(got[5])
    q, inv = fp8.quantize("grad_outputs", 0, x, record=False)
    assert (q.float() * inv).numpy()[:3].tolist() == [57344.0, -57344.0, 57344.0]  # e5m2 saturates too


# -- training ----------------------------------------------------------------------------------


def replay(model, recipe):
    """The core's NumPy transition on the amaxes each step recorded; equal to the plugin's states."""
    configs = recipe.configs
    first = model.seen[0]["states"]
    n = first["inputs"].scale.shape[0]
    state = {r: FP8State(np.zeros((n, configs[r].history_len), f32), np.ones(n, f32), np.ones(n, f32),
                         np.zeros(n, np.int32), np.zeros(n, np.int32)) for r in FP8_ROLES}
    for t, seen in enumerate(model.seen):
        for role in FP8_ROLES:
            new, _ = next_fp8_state(configs[role], state[role], seen["amax"][role].numpy())
            state[role] = select_fp8_state(seen["used"][role].numpy() & seen["applied"], new, state[role])
            got = numpy_states(seen["states"][role])
            for field in ("amax_history", "scale", "scale_inv"):
                assert same(getattr(got, field), getattr(state[role], field)), (t, role, field)
    return state


@pytest.mark.parametrize("fp8", [{"history_len": 3}, {"preset": "keras", "history_len": 4}, "torchao"])
def test_states_follow_the_core_transition_every_step(fp8):
    plugin = MixedPrecision("fp8-mixed", fp8=fp8)
    model = Net()
    fit(plugin, model, steps=6)
    assert plugin.fp8.names == ["net.0", "net.3", "net.5"]  # LayerNorm/Tanh are not FP8 matmuls
    replay(model, plugin.recipe.fp8)
    assert all(s["applied"] for s in model.seen)
    assert (plugin.fp8.states["inputs"].scale != 1).all()  # the scales moved


def test_fp32_regions_masters_and_states():
    policy = get_recipe("fp8-mixed").policy.with_fp32_modules("net.5")
    plugin = MixedPrecision("fp8-mixed", policy=policy)
    model = Net()
    trainer = fit(plugin, model, steps=2)
    assert plugin.fp8.names == ["net.0", "net.3"]  # the head is an FP32 region: no FP8 there
    assert model.net[5].weight.dtype == torch.float32 and model.net[0].weight.dtype == torch.bfloat16
    assert model.net[1].weight.dtype == torch.float32  # LayerNorm
    opt = trainer.optimizers[0]
    masters = [p for g in opt.param_groups for p in g["params"]]
    assert all(p.dtype == torch.float32 for p in masters)
    assert all(v.dtype == torch.float32 for s in opt.state.values() for v in s.values() if v.dim() > 0)
    assert plugin.master_weights
    # a whole container kept in FP32: none of its Linear layers is FP8
    assert [p for p, _ in fp8_modules(model, get_recipe("fp8-mixed").policy.with_fp32_modules("net"))] == []


def test_a_non_finite_amax_skips_the_step_and_stays_out_of_the_history():
    plugin = MixedPrecision("fp8-mixed", fp8={"history_len": 8})
    model = Net(bad_steps={3})
    snapshots = []

    class Snap(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            snapshots.append([p.detach().clone() for p in pl_module.parameters()])

    trainer = pl.Trainer(plugins=[plugin], max_steps=6, callbacks=[Snap()], **trainer_kwargs())
    trainer.fit(model, loader())
    assert [s["applied"] for s in model.seen] == [True, True, True, False, True, True]
    assert torch.isinf(model.seen[3]["amax"]["inputs"][0])
    assert plugin.loss_scaler.skipped == 1 and plugin.loss_scaler.overflows == 1
    assert all(torch.equal(a, b) for a, b in zip(snapshots[3], snapshots[4]))  # nothing applied
    assert torch.isfinite(plugin.fp8.states["inputs"].amax_history).all()
    replay(model, plugin.recipe.fp8)
    for role in FP8_ROLES:  # the skipped step left every state as it was
        before, after = model.seen[2]["states"][role], model.seen[3]["states"][role]
        assert torch.equal(before.amax_history, after.amax_history) and torch.equal(before.scale, after.scale)


def test_delayed_quantizes_with_the_previous_state_and_current_with_this_amax():
    torch.manual_seed(0)
    x = torch.randn(4, 8) * 3
    for mode in ("delayed", "current"):
        fp8 = TorchFP8(FP8Recipe.coerce({"mode": mode}))
        lin = nn.Linear(8, 2)
        fp8.install(lin, get_recipe("fp8-mixed").policy)
        with torch.enable_grad():
            fp8_linear(x, lin.weight, lin.bias, fp8, 0)
        q, inv = fp8.quantize("inputs", 0, x, record=False)
        scale = 1.0 if mode == "delayed" else 448.0 / float(x.abs().max())
        config = fp8.configs["inputs"]
        assert same((q.float() * inv).numpy(), fp8_qdq(x.numpy(), config, f32(scale), f32(1) / f32(scale)))
        fp8.before_step(None)
        fp8.after_step(True)
        assert fp8.states["inputs"].scale[0].item() == f32(448.0) / f32(fp8_amax(x.numpy()))


def test_evaluation_does_not_record():
    fp8 = TorchFP8(FP8Recipe())
    lin = nn.Linear(8, 2)
    fp8.install(lin, get_recipe("fp8-mixed").policy)
    with torch.no_grad():
        lin(torch.randn(3, 8))
    assert not fp8.recorded()
    lin(torch.randn(3, 8)).sum().backward()
    assert fp8.recorded()
    fp8.remove()
    assert "forward" not in lin.__dict__


def test_checkpoint_round_trip():
    plugin = MixedPrecision("fp8-mixed", fp8={"history_len": 4})
    fit(plugin, Net(), steps=3)
    state = plugin.state_dict()
    assert state["fp8"]["names"] == ["net.0", "net.3", "net.5"]
    other = MixedPrecision("fp8-mixed", fp8={"history_len": 4})
    other.fp8.install(Net(), other.policy)
    other.load_state_dict(state)
    for role in FP8_ROLES:
        assert all(torch.equal(a, b) for a, b in zip(other.fp8.states[role], plugin.fp8.states[role]))
    changed = MixedPrecision("fp8-mixed", fp8={"history_len": 5})
    changed.fp8.install(Net(), changed.policy)
    with pytest.raises(Exception, match="FP8 settings"):
        changed.load_state_dict(state)


# -- attention ---------------------------------------------------------------------------------


@pytest.mark.parametrize("batch_first,same_inputs,need_weights,kdim,masks", list(itertools.product(
    [False, True], [True, False], [True, False], [None, 6], [False, True]))[::3])
def test_attention_forward_is_torchs_with_the_projections_swapped(batch_first, same_inputs, need_weights, kdim,
                                                                   masks):
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(8, 2, batch_first=batch_first, kdim=kdim, vdim=kdim)
    n, length = 3, 4
    source = length if same_inputs and kdim is None else 5
    shape = (lambda s, e: (n, s, e)) if batch_first else (lambda s, e: (s, n, e))
    q = torch.randn(shape(length, 8))
    k = v = q if same_inputs and kdim is None else None
    if k is None:
        k, v = torch.randn(shape(source, kdim or 8)), torch.randn(shape(source, kdim or 8))
    am = kpm = None
    if masks:
        am = torch.rand(length, source) < 0.3
        am[:, 0] = False
        kpm = torch.rand(n, source) < 0.3
        kpm[:, 0] = False
    calls = []

    def plain(name, x, w, b):
        calls.append(name)
        return F.linear(x, w, b)

    ref = mha(q, k, v, key_padding_mask=kpm, attn_mask=am, need_weights=need_weights)
    got = mha_forward(mha, plain, mha.forward, q, k, v, key_padding_mask=kpm, attn_mask=am,
                      need_weights=need_weights)
    torch.testing.assert_close(got[0], ref[0], rtol=1e-5, atol=1e-6)
    if need_weights:
        torch.testing.assert_close(got[1], ref[1], rtol=1e-5, atol=1e-6)
    packed = same_inputs and kdim is None
    assert calls == (["in_proj"] if packed else ["q_proj", "k_proj", "v_proj"]) + ["out_proj"]


def test_attention_projections_train_in_fp8():
    plugin = MixedPrecision("fp8-mixed", fp8={"history_len": 4})
    model = Net(mha=True)
    fit(plugin, model, steps=3)
    names = plugin.fp8.names
    assert "attn.in_proj" in names and "attn.out_proj" in names
    used = model.seen[-1]["amax"]
    for part in ("attn.in_proj", "attn.out_proj"):
        i = names.index(part)
        assert all(used[r][i] > 0 for r in FP8_ROLES), part
    assert used["inputs"][names.index("attn.q_proj")] == 0  # self-attention: the packed projection only
    replay(model, plugin.recipe.fp8)


# -- diagnostics -------------------------------------------------------------------------------


def test_monitor_logs_the_fp8_metrics_and_memory():
    from lightning_ext import MixedPrecisionMonitor
    from mp_callbacks.diagnostics import FP8_AMAX, FP8_SATURATED_FRAC, FP8_SCALE, FP8_UNDERFLOW_FRAC
    from mp_callbacks.fp8 import flushed_fraction, fp8_state_bytes, saturated_fraction

    plugin = MixedPrecision("fp8-mixed", fp8={"history_len": 4})
    monitor = MixedPrecisionMonitor(log_every_n_steps=2)
    model = Net()
    batches = []

    class Keep(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            batches.append(batch[0].clone())

    trainer = pl.Trainer(plugins=[plugin], max_steps=4, callbacks=[monitor, Keep()], **trainer_kwargs())
    trainer.fit(model, loader())
    logged = [s for s in monitor.history if s.fp8]
    assert [s.step for s in logged] == [2, 4]
    metrics = logged[-1].metrics()
    for name in ("net.0", "net.3", "net.5"):
        for role in FP8_ROLES:
            i = plugin.fp8.names.index(name)
            assert metrics[f"{FP8_AMAX}/{name}/{role}"] == float(model.seen[3]["amax"][role][i])
            assert metrics[f"{FP8_SCALE}/{name}/{role}"] == float(model.seen[3]["states"][role].scale[i])
    # the first layer's input fractions against the core's NumPy meters, at the scale the step used
    x = batches[3].to(torch.bfloat16).float().numpy()
    scale = float(model.seen[2]["states"]["inputs"].scale[0])
    assert metrics[f"{FP8_SATURATED_FRAC}/net.0/inputs"] == saturated_fraction(x, scale)
    assert metrics[f"{FP8_UNDERFLOW_FRAC}/net.0/inputs"] == flushed_fraction(x, scale)
    assert 0 <= metrics[FP8_SATURATED_FRAC] <= 1 and 0 <= metrics[FP8_UNDERFLOW_FRAC] <= 1
    end = monitor.memory_reports[-1]
    assert end["actual"]["fp8_state"] == end["estimate"]["fp8_state"] == fp8_state_bytes(plugin.recipe.fp8, 3)
    assert end["actual"]["masters"] == end["estimate"]["masters"]  # bf16-master's model state otherwise
