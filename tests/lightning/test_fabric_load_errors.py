"""A checkpoint of another recipe or a foreign precision state, loaded through Fabric: the StateDictError
names the file ``fabric.load`` read when ``CheckedCheckpointIO`` read it (Fabric shows a precision plugin no
file; the Trainer's names its ``ckpt_path``), and only then."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from lightning.fabric import Fabric

from lightning_ext import CheckedCheckpointIO
from lightning_ext.fabric import MixedPrecision
from lightning_ext.trainer import MixedPrecision as TrainerMixedPrecision
from mp_callbacks.settings import StateDictError
from tests.lightning.helpers.models import TinyRegressor, loader, trainer_kwargs
from tests.lightning.test_fabric import setup, train


def _saved(tmp_path, recipe="16-master"):
    plugin = MixedPrecision(recipe)
    fabric, model, opt = setup(plugin)
    train(fabric, model, opt, range(2))
    path = tmp_path / f"{recipe}.pt"
    fabric.save(path, {"model": model, "optimizer": opt, "mp": plugin})
    return path, fabric.load(path)["mp"]


def _error(load) -> str:
    with pytest.raises(StateDictError) as info:
        load()
    return str(info.value)


def test_other_recipe_through_fabric_load_names_the_file(tmp_path):
    path, record = _saved(tmp_path)
    plugin = MixedPrecision("bf16-master")
    fabric, model, opt = setup(plugin)
    direct = _error(lambda: MixedPrecision("bf16-master").load_state_dict(record))  # no file: the same words
    assert "'16-master'" in direct and "'bf16-master'" in direct and str(tmp_path) not in direct
    assert _error(lambda: fabric.load(path, {"model": model, "optimizer": opt, "mp": plugin})) == direct
    checked = MixedPrecision("bf16-master")
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[checked, CheckedCheckpointIO()])
    message = _error(lambda: fabric.load(path, {"mp": checked}))
    assert message == f"{path}: {direct}"


def test_foreign_state_through_fabric_load_names_the_file(tmp_path):
    native = torch.amp.GradScaler("cpu")
    native.scale(torch.ones(()))
    path = tmp_path / "native.pt"
    torch.save({"mp": native.state_dict()}, path)
    plugin = MixedPrecision("16-mixed")
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin, CheckedCheckpointIO()])
    message = _error(lambda: fabric.load(path, {"mp": plugin}))
    assert message == f"{path}: {_error(lambda: MixedPrecision('16-mixed').load_state_dict(native.state_dict()))}"
    assert "GradScaler" in message


def test_the_trainer_still_names_its_ckpt_path(tmp_path):
    trainer = pl.Trainer(plugins=[TrainerMixedPrecision("16-master")], max_steps=1, **trainer_kwargs())
    trainer.fit(TinyRegressor(), loader())
    path = tmp_path / "a.ckpt"
    trainer.save_checkpoint(path)
    other = pl.Trainer(plugins=[TrainerMixedPrecision("bf16-master")], max_steps=2, **trainer_kwargs())
    message = _error(lambda: other.fit(TinyRegressor(), loader(), ckpt_path=path))
    assert message.startswith(f"{path}: ") and "'16-master'" in message
