"""Plugin state in Lightning checkpoints: plain data, safe to load, resumes bit-for-bit."""

import itertools

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.plugins.precision import MixedPrecision as NativeMixedPrecision

from lightning_ext import MixedPrecision
from mp_callbacks import StateDictError
from mp_callbacks.recipes import RECIPE_NAMES, get_recipe
from tests.lightning.helpers.models import TinyRegressor, loader, params_of, trainer_kwargs

SCALER = {"init_scale": 2.0**8, "growth_interval": 4}
INF = {3, 12, 21}


def _plugin(recipe: str) -> MixedPrecision:
    return MixedPrecision(recipe, scaler=SCALER)


def _fit(recipe: str, epochs: int, ckpt_path=None):
    model = TinyRegressor(inf_steps=INF, scheduler=True, norm=True)
    trainer = pl.Trainer(plugins=[_plugin(recipe)], max_epochs=epochs, **trainer_kwargs())
    trainer.fit(model, loader(), ckpt_path=ckpt_path)
    return model, trainer


def _opt_state(trainer) -> list[dict]:
    return [{k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()}
            for s in trainer.optimizers[0].state_dict()["state"].values()]


@pytest.mark.parametrize("recipe", ["16-master", "16-mixed", "bf16-master"])
def test_resume_is_bit_for_bit(tmp_path, recipe):
    full_model, full_trainer = _fit(recipe, 4)

    _, first = _fit(recipe, 2)
    path = tmp_path / "k.ckpt"
    first.save_checkpoint(path)
    ckpt = torch.load(path, weights_only=True)  # plain data only: no pickled code
    state = ckpt["MixedPrecision"]
    assert state["recipe"] == recipe and state["scaler"]["state"]["steps"] == 16
    assert bool(state["masters"]) == recipe.endswith("master")

    resumed_model, resumed = _fit(recipe, 4, ckpt_path=path)
    ref, got = params_of(full_model), params_of(resumed_model)
    for name in ref:
        assert torch.equal(ref[name], got[name]), name
    a, b = full_trainer.precision_plugin.state_dict(), resumed.precision_plugin.state_dict()
    assert a["scaler"] == b["scaler"]  # scale, trackers and every counter
    assert a["masters"].keys() == b["masters"].keys()
    for name in a["masters"]:
        assert torch.equal(a["masters"][name], b["masters"][name]), name
    for sa, sb in zip(_opt_state(full_trainer), _opt_state(resumed)):
        assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    assert full_trainer.optimizers[0].param_groups[0]["lr"] == resumed.optimizers[0].param_groups[0]["lr"]
    assert full_model.scales[16:] == resumed_model.scales


def test_other_recipe_or_schema_is_a_clear_error(tmp_path):
    _, trainer = _fit("16-master", 1)
    state = trainer.precision_plugin.state_dict()
    with pytest.raises(StateDictError, match=r"'16-master'.*'bf16-master'"):
        MixedPrecision("bf16-master").load_state_dict(state)
    with pytest.raises(StateDictError, match="different config"):
        MixedPrecision("16-master").load_state_dict(state)  # default torch preset, not SCALER
    with pytest.raises(StateDictError, match="schema v99"):
        _plugin("16-master").load_state_dict({**state, "schema_version": 99})
    native = torch.amp.GradScaler("cpu")
    native.scale(torch.ones(()))
    with pytest.raises(StateDictError, match="GradScaler.*lightning_ext.MixedPrecision\\('16-mixed'\\)"):
        MixedPrecision("16-mixed").load_state_dict(native.state_dict())

    # through the Trainer: a checkpoint of another recipe fails at resume, naming both
    path = tmp_path / "a.ckpt"
    trainer.save_checkpoint(path)
    model = TinyRegressor(norm=True)
    other = pl.Trainer(plugins=[MixedPrecision("bf16-master")], max_epochs=2, **trainer_kwargs())
    with pytest.raises(StateDictError, match=r"'16-master'.*'bf16-master'"):
        other.fit(model, loader(), ckpt_path=path)


def test_native_checkpoint_is_rejected_by_name(tmp_path):
    model = TinyRegressor()
    trainer = pl.Trainer(plugins=[NativeMixedPrecision("16-mixed", "cpu")], max_steps=1, **trainer_kwargs())
    trainer.fit(model, loader())
    path = tmp_path / "native.ckpt"
    trainer.save_checkpoint(path)
    ours = pl.Trainer(plugins=[MixedPrecision("16-mixed")], max_steps=2, **trainer_kwargs())
    with pytest.raises(StateDictError, match="native MixedPrecision"):
        ours.fit(TinyRegressor(), loader(), ckpt_path=path)


def test_exported_weights_are_the_masters(tmp_path):
    """A *-master checkpoint's model weights are the FP32 masters: what an FP32 model loads."""
    _, trainer = _fit("bf16-master", 1)
    path = tmp_path / "m.ckpt"
    trainer.save_checkpoint(path)
    ckpt = torch.load(path, weights_only=True)
    masters = trainer.precision_plugin.master_state_dict()
    assert masters and all(ckpt["state_dict"][k].dtype == torch.float32 for k in masters)
    fp32 = TinyRegressor(norm=True)
    fp32.load_state_dict(ckpt["state_dict"])
    for name, p in fp32.named_parameters():
        if name in masters:
            assert torch.equal(p.detach(), masters[name]), name
    # the masters really carry more than the bf16 weights do
    low = dict(trainer.lightning_module.named_parameters())
    assert any(not torch.equal(low[k].float(), masters[k]) for k in masters)


class ResumeStart(pl.Callback):
    """At train start of a resumed fit: the FP32 values the optimizer updates and the Adam step counts."""

    def on_train_start(self, trainer, pl_module):
        opt = trainer.optimizers[0]
        self.updated = [p.detach().clone() for g in opt.param_groups for p in g["params"]]
        self.steps = [int(opt.state[p]["step"]) for g in opt.param_groups for p in g["params"] if p in opt.state]


@pytest.mark.parametrize("saved,resumed", [p for p in itertools.product(RECIPE_NAMES, RECIPE_NAMES) if p[0] != p[1]])
def test_recipe_change_on_resume(tmp_path, saved, resumed):
    _, first = _fit(saved, 1)
    path = tmp_path / "a.ckpt"
    first.save_checkpoint(path)
    ckpt = torch.load(path, weights_only=True)
    opt_steps = [int(s["step"]) for s in ckpt["optimizer_states"][0]["state"].values()]
    start = ResumeStart()
    model = TinyRegressor(inf_steps=INF, scheduler=True, norm=True)
    trainer = pl.Trainer(plugins=[MixedPrecision(resumed, scaler=None, allow_recipe_change=True)],
                         max_epochs=2, callbacks=[start], **trainer_kwargs())
    with pytest.warns(UserWarning, match=f"resuming a '{saved}' checkpoint under '{resumed}'.*restarts"):
        trainer.fit(model, loader(), ckpt_path=path)
    names = [n for n, _ in model.named_parameters()]
    # the optimizer continues from the checkpoint's FP32 values (masters or params) and Adam state;
    # bf16-kahan/-sr keep no FP32 copy: their bf16 weights are those values rounded
    rounds = get_recipe(resumed).master.rounds_updates
    for name, value in zip(names, start.updated, strict=True):
        want = ckpt["state_dict"][name].float()
        assert torch.equal(value.float(), want.to(value.dtype).float() if rounds else want), name
    assert start.steps == opt_steps
    assert trainer.global_step == 16 and all(torch.isfinite(p).all() for p in model.parameters())
    # the scaler restarted from its config: it counts this fit's 8 steps; global step 12 (inf) was skipped
    # (fp16 targets also skip while their default 2**16 scale backs off to fit this model)
    scaler = trainer.precision_plugin.loss_scaler
    assert scaler.steps == 8 and scaler.skipped >= 1
    assert scaler.skipped == 1 or (resumed.startswith("16") and scaler.get_scale() < 2.0**16)


def test_checkpointed_fp32_rule_is_restored(tmp_path):
    model = TinyRegressor(norm=True)
    plugin = MixedPrecision("16-mixed")
    trainer = pl.Trainer(plugins=[plugin], max_steps=2, **trainer_kwargs())
    trainer.fit(model, loader())
    plugin.keep_in_fp32("net.0")
    path = tmp_path / "k.ckpt"
    trainer.save_checkpoint(path)
    fresh = MixedPrecision("16-mixed")
    model2 = TinyRegressor(norm=True)
    pl.Trainer(plugins=[fresh], max_steps=3, **trainer_kwargs()).fit(model2, loader(), ckpt_path=path)
    assert ("net.0", "float32") in fresh.policy.module_rules
