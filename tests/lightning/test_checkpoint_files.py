"""Checkpoint files the plugin cannot resume from as they are: truncated or foreign files are errors naming the
file, what is wrong and what to do; a checkpoint of a plain Lightning run (no plugin state) resumes the model and
optimizer as Lightning wrote them and starts the plugin's state fresh, with a warning."""

import zipfile

import lightning.pytorch as pl
import pytest
import torch
from lightning.fabric import Fabric
from lightning.pytorch.plugins.precision import MixedPrecision as NativeMixedPrecision

from lightning_ext import CheckedCheckpointIO, CheckpointFileError, FabricMixedPrecision, MixedPrecision
from lightning_ext.checkpoint import check_checkpoint_file
from mp_callbacks import StateDictError
from tests.lightning.helpers.models import TinyRegressor, loader, trainer_kwargs

SCALER = {"init_scale": 2.0**8, "growth_interval": 4}


def _saved(tmp_path, plugins, name="a.ckpt", **kw):
    trainer = pl.Trainer(plugins=plugins, max_epochs=1, **trainer_kwargs(**kw))
    trainer.fit(TinyRegressor(norm=True), loader())
    path = tmp_path / name
    trainer.save_checkpoint(path)
    return path


def _truncated(path, tmp_path):
    data = path.read_bytes()
    cut = tmp_path / "cut.ckpt"
    cut.write_bytes(data[: len(data) // 2])
    return cut


def test_the_file_check_names_what_is_wrong(tmp_path):
    path = _saved(tmp_path, [MixedPrecision("16-master", scaler=SCALER)])
    check_checkpoint_file(path)  # complete: torch reads it
    assert "MixedPrecision" in torch.load(path, weights_only=True)
    check_checkpoint_file(tmp_path)  # a directory (a sharded checkpoint) is its loader's business
    with pytest.raises(CheckpointFileError, match="nope.ckpt: no such checkpoint file"):
        check_checkpoint_file(tmp_path / "nope.ckpt")
    cut = _truncated(path, tmp_path)
    with pytest.raises((RuntimeError, OSError)):  # what torch itself says: no remedy
        torch.load(cut, weights_only=True)
    with pytest.raises(CheckpointFileError, match=rf"{cut}.*truncated or damaged.*earlier checkpoint"):
        check_checkpoint_file(cut)
    empty = tmp_path / "empty.ckpt"
    empty.write_bytes(b"")
    with pytest.raises(CheckpointFileError, match=r"\(0 bytes\) is empty"):
        check_checkpoint_file(empty)
    h5 = tmp_path / "model.weights.h5"
    h5.write_bytes(b"\x89HDF\r\n\x1a\n" + bytes(64))
    with pytest.raises(CheckpointFileError, match="HDF5 file"):
        check_checkpoint_file(h5)
    other = tmp_path / "other.zip"
    with zipfile.ZipFile(other, "w") as z:
        z.writestr("config.json", "{}")
    with pytest.raises(CheckpointFileError, match=r"not a torch checkpoint \(it holds \['config.json'\]"):
        check_checkpoint_file(other)


def test_a_truncated_checkpoint_is_a_clear_error_through_the_trainer_and_fabric(tmp_path):
    cut = _truncated(_saved(tmp_path, [MixedPrecision("16-master", scaler=SCALER)]), tmp_path)
    trainer = pl.Trainer(plugins=[MixedPrecision("16-master", scaler=SCALER), CheckedCheckpointIO()], max_epochs=2,
                         **trainer_kwargs())
    with pytest.raises(CheckpointFileError, match=rf"{cut} .*truncated"):
        trainer.fit(TinyRegressor(norm=True), loader(), ckpt_path=cut)
    mp = FabricMixedPrecision("16-master", scaler=SCALER)
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[mp, CheckedCheckpointIO()])
    with pytest.raises(CheckpointFileError, match=rf"{cut} .*truncated"):
        fabric.load(cut, {"mp": mp})


class _Start(pl.Callback):
    """At train start: the values the optimizer updates and Adam's step counts."""

    def on_train_start(self, trainer, pl_module):
        opt = trainer.optimizers[0]
        self.values = [p.detach().clone() for g in opt.param_groups for p in g["params"]]
        self.steps = [int(opt.state[p]["step"]) for g in opt.param_groups for p in g["params"] if p in opt.state]


@pytest.mark.parametrize("native", ["32-true", "bf16-mixed"])
def test_a_plain_lightning_checkpoint_starts_the_plugin_state_fresh_with_a_warning(tmp_path, native):
    plugins = [NativeMixedPrecision(native, "cpu")] if native != "32-true" else []
    path = _saved(tmp_path, plugins, precision=None if plugins else "32-true")
    ckpt = torch.load(path, weights_only=True)
    assert "MixedPrecision" not in ckpt  # Lightning writes no precision state for these
    start = _Start()
    model = TinyRegressor(norm=True)
    trainer = pl.Trainer(plugins=[MixedPrecision("bf16-master")], max_epochs=2, callbacks=[start], **trainer_kwargs())
    with pytest.warns(UserWarning, match=rf"{path} holds no lightning_ext.MixedPrecision state.*start fresh"):
        trainer.fit(model, loader(), ckpt_path=path)
    # model and optimizer resume as Lightning wrote them: the masters are the checkpoint's FP32 weights
    names = [n for n, _ in model.named_parameters()]
    for name, value in zip(names, start.values, strict=True):
        assert torch.equal(value, ckpt["state_dict"][name].float()), name
    assert start.steps == [int(s["step"]) for s in ckpt["optimizer_states"][0]["state"].values()]
    assert trainer.global_step == 16 and trainer.precision_plugin.loss_scaler.steps == 8  # counts this fit only


def test_a_foreign_checkpoint_error_names_the_file_and_the_remedy(tmp_path):
    ours = _saved(tmp_path, [MixedPrecision("16-master", scaler=SCALER)])
    other = pl.Trainer(plugins=[MixedPrecision("bf16-master")], max_epochs=2, **trainer_kwargs())
    with pytest.raises(StateDictError, match=rf"{ours}: .*'16-master'.*'bf16-master'"):
        other.fit(TinyRegressor(norm=True), loader(), ckpt_path=ours)
    native = _saved(tmp_path, [NativeMixedPrecision("16-mixed", "cpu")], name="native.ckpt")
    trainer = pl.Trainer(plugins=[MixedPrecision("16-mixed")], max_epochs=2, **trainer_kwargs())
    with pytest.raises(StateDictError, match=rf"{native}: .*GradScaler.*native MixedPrecision.*del ckpt"):
        trainer.fit(TinyRegressor(norm=True), loader(), ckpt_path=native)
