"""Tiny model factories for the ``mpx compare --lightning/--keras`` tests (the third-party ones are in examples/).

* :func:`make_lightning_mlp`: a module with its own ``train_dataloader`` and no validation (the training
  loss is the metric);
* :func:`make_fragile_module`: trains under FP32 and fp16, raises in ``training_step`` when its weights
  are bfloat16 (``*-master``, ``bf16-kahan``/``-sr``), and ends its process under ``16-master`` (a run
  whose process dies);
* :func:`build_fragile_keras` / :func:`make_keras_arrays`: a compiled Dense model that cannot be built
  under a low-precision global policy (any recipe but ``32-true`` and the ``*-master`` ones fails), and
  its array data;
* :func:`build_keras_mlp`: the same model without the refusal (it builds under every recipe).
"""

from __future__ import annotations

import os

import numpy as np


def _torch_data(n: int = 256, seed: int = 0):
    import torch

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    return x, (x[:, :2].sum(-1) > 0).long()


def make_lightning_mlp():
    import lightning.pytorch as pl
    import torch
    import torch.nn.functional as F
    from torch.utils.data import DataLoader, TensorDataset

    class TinyMLP(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.cross_entropy(self.net(x).float(), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

        def train_dataloader(self):
            return DataLoader(TensorDataset(*_torch_data()), batch_size=16)

    return TinyMLP()


def make_fragile_module():
    import torch

    module = make_lightning_mlp()
    plain = type(module).training_step

    def training_step(batch, batch_idx):
        dtype = module.net[0].weight.dtype
        if dtype == torch.float16:
            os._exit(3)  # noqa: SLF001 - the run's process dies without a result
        if dtype == torch.bfloat16:
            raise RuntimeError("this model refuses bfloat16 weights\nsecond line")
        return plain(module, batch, batch_idx)

    module.training_step = training_step
    return module


def build_fragile_keras():
    import keras

    policy = keras.config.dtype_policy().name
    if policy != "float32" and policy.startswith("mixed"):
        raise TypeError(f"cannot build under the {policy} policy")
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(2)])
    model.compile(optimizer=keras.optimizers.Adam(1e-2),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    return model


def build_keras_mlp():
    import keras

    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(2)])
    model.compile(optimizer=keras.optimizers.Adam(1e-2),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    return model


def make_keras_arrays():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((128, 8)).astype("float32")
    y = (x[:, :2].sum(-1) > 0).astype("int64")
    return {"train": (x[:96], y[:96]), "validation": (x[96:], y[96:])}
