"""The first run in a fresh process trains as Lightning's own plugin does, bit for bit.

Nothing in ``lightning_ext`` may draw from the user's random generators: a draw (a self-check made of
``torch.randn``, say) on the first use in a process shifts every later draw of the user's run (dropout masks,
initialisations), so the first run would leave native's numbers while later ones match.  Each case runs in a
fresh interpreter, ours FIRST, then Lightning's own precision with the same seed, model and data; the final
weights must be equal bit for bit.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import sys
import lightning.pytorch as pl
import torch
from torch import nn

import lightning_ext
from lightning.pytorch.plugins import MixedPrecision as NativeMixedPrecision
from tests.lightning.helpers.models import loader, trainer_kwargs

recipe, out = sys.argv[1], sys.argv[2]
torch.set_num_threads(1)


class Net(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.Dropout(0.3), nn.ReLU(), nn.Linear(32, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x).float(), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def fit(ours):
    torch.manual_seed(1234)
    model = Net()
    if recipe == "32-true":
        kwargs = {"plugins": [lightning_ext.MixedPrecision("32-true", "cpu")]} if ours else {"precision": "32-true"}
    else:
        plugin = lightning_ext.MixedPrecision(recipe, "cpu") if ours else NativeMixedPrecision(recipe, "cpu")
        kwargs = {"plugins": [plugin]}
    pl.Trainer(max_steps=6, **trainer_kwargs(**kwargs)).fit(model, loader())
    return {name: p.detach().clone() for name, p in model.named_parameters()}


ours = fit(True)  # first in this process
theirs = fit(False)
torch.save({"ours": ours, "theirs": theirs}, out)
"""


@pytest.mark.parametrize("recipe", ["bf16-mixed", "32-true"])
def test_the_first_run_in_a_fresh_process_equals_native(recipe, tmp_path):
    out = tmp_path / "weights.pt"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-c", SCRIPT, recipe, str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = torch.load(out, weights_only=True)
    ours, theirs = got["ours"], got["theirs"]
    assert sorted(ours) == sorted(theirs)
    for name in ours:
        assert torch.equal(ours[name].view(torch.int32), theirs[name].view(torch.int32)), name
