"""Reduced form of the FSDP2 block of docs/guides/scaling-out.md (16 GPUs on 2 nodes there).

The same ``configure_model`` (norms in their own FP32 units, blocks gathered in bf16, the root with
FP32 outputs) and the same plugin and monitor, under ``ModelParallelStrategy`` with one data-parallel
rank on one CPU process: the sharding, the plugin's setup checks and the masters-are-the-shards path
run; the collectives are trivial.  ``tests/lightning/test_scale_out.py`` covers 2 ranks."""

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from torch.distributed.fsdp import fully_shard

from lightning_ext import MixedPrecision, MixedPrecisionMonitor, fully_shard_model


class Block(nn.Module):
    def __init__(self, width=16):
        super().__init__()
        self.norm, self.lin = nn.LayerNorm(width), nn.Linear(width, width)

    def forward(self, x):
        return x + self.lin(self.norm(x))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks, self.head = nn.ModuleList([Block(), Block()]), nn.Linear(16, 4)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class LitModel(pl.LightningModule):
    def __init__(self, one_call=False):
        super().__init__()
        self.model, self.one_call = Net(), one_call

    def configure_model(self):
        plugin, mesh = self.trainer.precision_plugin, self.device_mesh["data_parallel"]
        if self.one_call:
            fully_shard_model(self.model, plugin.recipe, mesh, units=["Block"])
            return
        for block in self.model.blocks:
            fully_shard(block.norm, mesh=mesh, mp_policy=plugin.fsdp_policy(block.norm))  # FP32 gathers
            fully_shard(block, mesh=mesh, mp_policy=plugin.fsdp_policy(block))            # bf16 gathers
        fully_shard(self.model, mesh=mesh, mp_policy=plugin.fsdp_policy())               # root: FP32 outputs

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.model(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self):
        data = torch.utils.data.TensorDataset(torch.randn(32, 16), torch.randint(0, 4, (32,)))
        return torch.utils.data.DataLoader(data, batch_size=8)


for one_call in (False, True):
    trainer = pl.Trainer(accelerator="cpu", devices=1, num_nodes=1, max_steps=3,
                         strategy=ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=1),
                         plugins=[MixedPrecision("bf16-master", "cpu")], callbacks=[MixedPrecisionMonitor()])
    model = LitModel(one_call)
    trainer.fit(model)
    plugin = trainer.precision_plugin
    assert not plugin.masters, "under FSDP2 the FP32 shards are the masters: no second copy"
    assert all(p.dtype == torch.float32 for p in model.parameters())
print("fsdp2 reduced form: OK")
