"""What the code blocks of the long README (the one before docs/README.proposed.md replaced it) take as given.

Its blocks are fragments of a user's script: they use a ``model`` (a LightningModule), ``build_model()``,
``x, y`` and ``loss`` (Keras), and resume from a ``last.ckpt`` saved under ``16-mixed``.  This module
defines those, small, so that the fragments run as written.  :mod:`tests.docs.snippets` runs it first,
only while README.md is not the proposed one; the short README's blocks are complete by themselves."""

import keras
import lightning.pytorch as pl
import numpy as np
import torch
from torch import nn

from lightning_ext import MixedPrecision


class _Lit(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self):
        data = torch.utils.data.TensorDataset(torch.randn(32, 8), torch.randint(0, 4, (32,)))
        return torch.utils.data.DataLoader(data, batch_size=8)


def build_model():
    return keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                             keras.layers.Dense(4, activation="softmax")])


model = _Lit()
x = np.random.default_rng(0).normal(size=(64, 8)).astype("float32")
y = np.random.default_rng(1).integers(0, 4, size=(64,))
loss = "sparse_categorical_crossentropy"
_trainer = pl.Trainer(max_steps=2, plugins=[MixedPrecision("16-mixed")])
_trainer.fit(_Lit())
_trainer.save_checkpoint("last.ckpt")
