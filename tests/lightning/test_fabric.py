"""lightning_ext.fabric.MixedPrecision under Lightning Fabric (one CPU process): every recipe, skip semantics
equal to the Trainer plugin's, clipping on unscaled gradients, exact resume, the monitor and the divergence rule."""

from __future__ import annotations

import pickle

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from lightning.fabric.loggers import CSVLogger
from torch import nn

import lightning_ext
from lightning_ext import FabricMonitor, MasterWeights, UpdateRounding
from lightning_ext.fabric import MixedPrecision
from lightning_ext.support import check_strategy
from mp_callbacks.diagnostics import DivergenceError
from tests.lightning.helpers.models import TinyRegressor, loader, trainer_kwargs

RECIPES = ["32-true", "16-mixed", "bf16-mixed", "16-master", "bf16-master", "bf16-kahan", "bf16-sr", "fp8-mixed"]
STORAGE = {"16-master": torch.float16, "bf16-master": torch.bfloat16, "bf16-kahan": torch.bfloat16,
           "bf16-sr": torch.bfloat16, "fp8-mixed": torch.bfloat16}
COMPUTE = {"32-true": torch.float32, "16-mixed": torch.float16, "16-master": torch.float16}
SCALER = {"init_scale": 2.0**8, "growth_interval": 1000}


def tiny(norm: bool = True) -> nn.Sequential:
    """TinyRegressor's ``net`` with the same initial weights (seed 0)."""
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(8, 16)] + ([nn.LayerNorm(16)] if norm else []) + [nn.ReLU(), nn.Linear(16, 1)]
    return nn.Sequential(*layers)


def plugin_for(recipe: str, **kw) -> MixedPrecision:
    return MixedPrecision(recipe, scaler=SCALER if recipe.startswith("16") else None, **kw)


def setup(plugin: MixedPrecision, norm: bool = True, callbacks=(), loggers=None):
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin], callbacks=list(callbacks), loggers=loggers)
    model = tiny(norm)
    model, opt = fabric.setup(model, torch.optim.Adam(model.parameters(), lr=1e-2))
    return fabric, model, opt


def train(fabric, model, opt, steps: range, inf_steps=(), clip=None, sched=None) -> list[float]:
    """The documented Fabric loop over TinyRegressor's batches; ``inf_steps`` multiply the loss by inf."""
    batches, losses = list(loader()), []
    for step in steps:
        x, y = batches[step % len(batches)]
        loss = F.mse_loss(model(x), y)
        losses.append(float(loss.detach()))
        fabric.backward(loss * float("inf") if step in inf_steps else loss)
        if clip is not None:
            fabric.clip_gradients(model, opt, max_norm=clip)
        opt.step()
        if sched is not None and not fabric.strategy.precision.last_step_skipped(opt):
            sched.step()  # Fabric's LR-schedule rule: applied steps only
        opt.zero_grad()
    return losses


def snapshot(model, opt, plugin) -> dict:
    raw = opt.optimizer if hasattr(opt, "optimizer") else opt
    return {"params": {k: v.detach().clone() for k, v in model.named_parameters()},
            "masters": {k: v.clone() for k, v in plugin.master_state_dict().items()},
            "state": {f"{i}.{k}": v.clone() for i, p in enumerate(raw.param_groups[0]["params"])
                      for k, v in raw.state.get(p, {}).items() if torch.is_tensor(v)},
            "comp": {k: v.clone() for k, v in (plugin.rounding.compensation() if plugin.rounding else {}).items()},
            "scaler": plugin.loss_scaler.state_dict()}


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(same(a[k], b[k]) if isinstance(a[k], dict) else
                                        torch.equal(a[k], b[k]) if torch.is_tensor(a[k]) else a[k] == b[k] for k in a)


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_recipe_trains_under_fabric(recipe):
    plugin = plugin_for(recipe)
    fabric, model, opt = setup(plugin)
    seen = []
    model.module[0].register_forward_pre_hook(
        lambda m, args: seen.append((args[0].dtype, torch.is_autocast_cpu_enabled())))
    losses = train(fabric, model, opt, range(4))
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]
    assert model(torch.zeros(2, 8)).dtype == torch.float32  # convert_output
    assert seen[0] == (COMPUTE.get(recipe, torch.bfloat16), recipe != "32-true")  # convert_input, autocast
    assert model.module[0].weight.dtype == STORAGE.get(recipe, torch.float32)
    assert model.module[1].weight.dtype == torch.float32  # the policy keeps norms in FP32
    group = opt.optimizer.param_groups[0]["params"]
    assert all(p.dtype == torch.float32 for p in group) == (recipe not in ("bf16-kahan", "bf16-sr"))  # masters
    assert isinstance(plugin.weight_store, MasterWeights if recipe in ("16-master", "bf16-master", "fp8-mixed") else
                      UpdateRounding if recipe in ("bf16-kahan", "bf16-sr") else type(None))
    assert plugin.loss_scaler.steps == 4 and plugin.loss_scaler.skipped == 0


@pytest.mark.parametrize("recipe", ["16-mixed", "16-master", "bf16-master", "bf16-kahan"])
def test_skipped_step_changes_nothing_and_matches_the_trainer_plugin(recipe):
    plugin = plugin_for(recipe)
    fabric, model, opt = setup(plugin)
    sched = torch.optim.lr_scheduler.StepLR(opt.optimizer, step_size=1, gamma=0.9)
    train(fabric, model, opt, range(2), sched=sched)
    before = snapshot(model, opt, plugin)
    train(fabric, model, opt, range(2, 3), inf_steps={2}, sched=sched)
    after = snapshot(model, opt, plugin)
    assert plugin.last_step_skipped(opt) and plugin.loss_scaler.skipped == 1
    for part in ("params", "masters", "state", "comp"):  # nothing the model learns from changed (Adam's step too)
        assert same(before[part], after[part]), part
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-2 * 0.9**2)  # the schedule held
    train(fabric, model, opt, range(3, 6), sched=sched)
    ours = [p.detach() for p in model.parameters()]
    # the Trainer plugin on the same model, data and injection: the same weights bit for bit
    trainer_model = TinyRegressor(inf_steps={2}, norm=True, scheduler=True)
    trainer_plugin = lightning_ext.MixedPrecision(recipe, scaler=SCALER if recipe.startswith("16") else None)
    pl.Trainer(plugins=[trainer_plugin], max_steps=6, **trainer_kwargs()).fit(trainer_model, loader())
    for a, b in zip(ours, trainer_model.parameters()):
        assert torch.equal(a, b.detach())
    assert trainer_plugin.loss_scaler.state_dict() == plugin.loss_scaler.state_dict()


def test_clip_gradients_sees_unscaled_gradients():
    """The total norm Fabric's clipping returns, and the clipped gradients, are an FP32 backward's (no scale)."""
    plugin = MixedPrecision("16-mixed", scaler={"init_scale": 2.0**10})
    fabric, model, opt = setup(plugin, norm=False)
    ref = tiny(norm=False)
    x, y = next(iter(loader()))
    with torch.autocast("cpu", dtype=torch.float16):  # the same forward, backward without a scale
        ref_out = ref(x)
    F.mse_loss(ref_out.float(), y).backward()
    ref_norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in ref.parameters()]))
    fabric.backward(F.mse_loss(model(x), y))
    limit = ref_norm.item() / 2  # clipping bites
    norm = fabric.clip_gradients(model, opt, max_norm=limit)
    assert norm.item() == pytest.approx(ref_norm.item(), rel=1e-6)
    torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm=limit)
    for p, r in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, r.grad, rtol=1e-6, atol=0)
    opt.step()
    opt.zero_grad()
    # an overflow: clipping finds nothing to clip (no error_if_nonfinite raise), the step skips
    fabric.backward(F.mse_loss(model(x), y) * float("inf"))
    assert fabric.clip_gradients(model, opt, max_norm=0.5).item() == 0.0
    opt.step()
    assert plugin.last_step_skipped(opt) and plugin.loss_scaler.skipped == 1


def test_clip_gradients_of_masters():
    """Under bf16-master the clipped gradients are the FP32 masters' (what the optimizer updates)."""
    plugin = MixedPrecision("bf16-master")
    fabric, model, opt = setup(plugin)
    x, y = next(iter(loader()))
    fabric.backward(F.mse_loss(model(x), y))
    fabric.clip_gradients(model, opt, clip_val=1e-3)
    masters = opt.optimizer.param_groups[0]["params"]
    assert all(p.grad.dtype == torch.float32 and p.grad.abs().max() <= 1e-3 for p in masters if p.grad is not None)
    assert all(p.grad is None for p in model.parameters() if p.dtype == torch.bfloat16)  # moved to the masters


@pytest.mark.parametrize("recipe", ["bf16-master", "16-mixed", "bf16-kahan"])
def test_save_load_resume_equals_the_uninterrupted_run(recipe, tmp_path):
    inf = {1}  # a skip before the save: the scaler state matters
    plugin = plugin_for(recipe)
    fabric, model, opt = setup(plugin)
    train(fabric, model, opt, range(6), inf_steps=inf)
    whole = snapshot(model, opt, plugin)

    plugin = plugin_for(recipe)
    fabric, model, opt = setup(plugin)
    train(fabric, model, opt, range(3), inf_steps=inf)
    fabric.save(tmp_path / "ckpt.pt", {"model": model, "optimizer": opt, "mp": fabric.strategy.precision, "step": 3})

    plugin = plugin_for(recipe)  # a fresh process's objects
    fabric, model, opt = setup(plugin)
    plugin.setup_optimizers(opt)  # the weight store in the optimizer before its state loads
    state = {"model": model, "optimizer": opt, "mp": fabric.strategy.precision}
    rest = fabric.load(tmp_path / "ckpt.pt", state)
    assert rest == {"step": 3}
    train(fabric, model, opt, range(3, 6), inf_steps=inf)
    assert same(snapshot(model, opt, plugin), whole)


def test_the_store_goes_around_the_optimizer_at_its_first_step_or_when_shown():
    """Fabric shows a precision plugin no optimizer: the weight store is installed at the optimizer's first step
    (the same training as when shown earlier with setup_optimizers); state loaded before that is a warning."""
    plugin = plugin_for("bf16-master")
    fabric, model, opt = setup(plugin)
    plugin.setup_optimizers(opt)
    assert len(plugin.masters) == 4  # installed now
    train(fabric, model, opt, range(3))
    eager = [p.detach().clone() for p in model.parameters()]
    saved = opt.state_dict()
    plugin = plugin_for("bf16-master")
    fabric, model, opt = setup(plugin)
    assert len(plugin.masters) == 0  # nothing installed at setup
    train(fabric, model, opt, range(3))
    assert len(plugin.masters) == 4
    assert all(torch.equal(a, b.detach()) for a, b in zip(eager, model.parameters()))
    plugin = plugin_for("bf16-master")
    fabric, model, opt = setup(plugin)
    opt.load_state_dict(saved)  # into the bf16 parameters: torch casts the FP32 state
    with pytest.warns(UserWarning, match="state was loaded before the plugin saw the optimizer.*setup_optimizers"):
        train(fabric, model, opt, range(1))


def test_monitor_as_a_fabric_callback(tmp_path):
    monitor = FabricMonitor(log_every_n_steps=2)
    plugin = MixedPrecision("16-mixed", scaler=SCALER)
    fabric, model, opt = setup(plugin, callbacks=[monitor], loggers=CSVLogger(tmp_path))
    losses = train(fabric, model, opt, range(6), inf_steps={2})
    monitor.detach()
    steps = {s.step: s for s in monitor.history}
    assert sorted(steps) == [2, 3, 4, 6]  # logging steps and the overflow
    assert steps[3].overflow and steps[3].scale == 2.0**8 and steps[4].scale == 2.0**7 and steps[6].skipped_total == 1
    assert steps[2].loss == pytest.approx(losses[1]) and steps[2].grad_norm > 0
    assert [r["when"] for r in monitor.memory_reports] == ["train_start", "train_end"]
    assert plugin.loss_scaler.monitor is None
    fabric.loggers[0].finalize("success")
    assert "mp/scale" in (tmp_path / "lightning_logs" / "version_0" / "metrics.csv").read_text().splitlines()[0]


def test_divergence_rule_raises_from_optimizer_step():
    plugin = MixedPrecision("16-mixed", scaler={"init_scale": 4.0}, divergence={"overflows_below": 3})
    fabric, model, opt = setup(plugin)
    batches = list(loader())
    with pytest.raises(DivergenceError, match="overflowed on 3 consecutive steps with a finite loss"):
        for step in range(50):
            x, y = batches[step % len(batches)]
            fabric.backward(F.mse_loss(model(x), y))
            next(iter(model.parameters())).grad.view(-1)[0] = float("inf")
            opt.step()
            opt.zero_grad()
    assert plugin.loss_scaler.skipped == 5 and plugin.loss_scaler.get_scale() == 0.125


def test_32_true_is_fabrics_own_32_true_bit_for_bit():
    """The user's optimizer runs as torch wrote it: Fabric's own 32-true loop's weights and optimizer state."""
    def run(plugins):
        fabric = Fabric(accelerator="cpu", devices=1, plugins=plugins)
        net = tiny()
        model, opt = fabric.setup(net, torch.optim.AdamW([
            {"params": net[0].parameters(), "weight_decay": 0.1},
            {"params": net[-1].parameters(), "weight_decay": 0.0, "lr": 3e-3}], lr=1e-2))
        train(fabric, model, opt, range(8))
        return model, opt.optimizer

    (model_a, opt_a), (model_b, opt_b) = run([MixedPrecision("32-true")]), run([])
    for p, q in zip(model_a.parameters(), model_b.parameters(), strict=True):
        assert torch.equal(p.view(torch.int32), q.view(torch.int32))
    for sa, sb in zip(opt_a.state.values(), opt_b.state.values(), strict=True):
        assert all(torch.equal(sa[k], sb[k]) for k in sa)


def test_one_class_for_both_and_what_each_refuses():
    trainer_cls = lightning_ext.MixedPrecision
    assert lightning_ext.FabricMixedPrecision is MixedPrecision and issubclass(trainer_cls, MixedPrecision)
    mro = trainer_cls.__mro__  # Lightning's TransformerEnginePrecision order: the Trainer base first
    assert mro.index(pl.plugins.precision.Precision) < mro.index(MixedPrecision)
    x = torch.ones(2)
    assert trainer_cls("bf16-mixed").convert_input(x) is x and MixedPrecision("bf16-mixed").convert_input(x).dtype \
        == torch.bfloat16
    restored = pickle.loads(pickle.dumps(MixedPrecision("16-mixed")))  # ddp_spawn pickles the plugin
    assert isinstance(restored.scaler, torch.amp.GradScaler) and restored.scaler.get_scale() == 2.0**16
    from lightning.fabric.strategies import FSDPStrategy

    with pytest.raises(Exception, match=r"FSDPStrategy.*ModelParallelStrategy \(FSDP2\).*Fabric\(strategy='fsdp'"):
        check_strategy(FSDPStrategy())
    plugin = MixedPrecision("bf16-master")
    fabric, model, _ = setup(plugin)
    lbfgs = fabric.setup_optimizers(torch.optim.LBFGS(model.parameters()))
    with pytest.raises(Exception, match="LBFGS"):
        plugin.setup_optimizers(lbfgs)
    fabric.backward(model(torch.ones(2, 8)).sum())
    with pytest.raises(Exception, match="LBFGS"):  # at its first step, where Fabric shows it
        lbfgs.step(lambda: None)


def test_the_trainer_plugin_in_fabric_names_the_fabric_one():
    # Lightning's own Trainer plugin fails here with "'NoneType' object has no attribute 'trainer'".
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[lightning_ext.MixedPrecision("bf16-mixed")])
    model, opt = fabric.setup(nn.Linear(4, 1), torch.optim.SGD(nn.Linear(4, 1).parameters(), lr=0.1))
    with pytest.raises(TypeError, match=r"with Fabric use lightning_ext\.fabric\.MixedPrecision"):
        fabric.backward(model(torch.ones(2, 4)).sum())
