"""Factories for ``mpx compare --lightning``: a Hugging Face GPT-2 built from its config (random init).

No weights are downloaded: ``GPT2Config`` + ``GPT2LMHeadModel(config)``.  The data is a learnable
synthetic language (each sequence counts up from a random start, modulo the vocabulary), so the
loss falls within a few dozen steps::

    mpx compare --lightning examples.compare_hf_gpt2:make_module \\
        --datamodule examples.compare_hf_gpt2:make_datamodule --steps 40 --out hf_report

``make_module`` returns a ``LightningModule`` whose ``validation_step`` logs ``val_loss`` (the metric
``mpx compare`` then compares); ``make_datamodule`` a ``LightningDataModule`` with train and
validation loaders.  The sizes are tiny (CPU tests); pass bigger ones through the factories' arguments.
Heavy imports sit at the top of the module: ``mpx compare`` imports it once, and every run's process
(a fork) starts with them done.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset
from transformers import GPT2Config, GPT2LMHeadModel  # at import: mpx imports this module once, before it forks

VOCAB, SEQ = 64, 16


class GPT2Module(pl.LightningModule):
    """``GPT2LMHeadModel`` from a config, trained on next-token prediction with AdamW."""

    def __init__(self, n_layer: int = 1, n_embd: int = 32, n_head: int = 2, lr: float = 3e-3) -> None:
        super().__init__()
        config = GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=n_head, vocab_size=VOCAB, n_positions=SEQ,
                            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                            bos_token_id=0, eos_token_id=0)
        self.model = GPT2LMHeadModel(config)
        self.lr = lr

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.model(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        loss = self.model(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss
        self.log("val_loss", loss.float(), batch_size=batch["input_ids"].shape[0])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


def counting_sequences(n: int, seed: int) -> torch.Tensor:
    """``n`` token sequences ``(s, s+1, s+2, ...) mod VOCAB`` with random starts ``s``."""
    starts = torch.randint(0, VOCAB, (n, 1), generator=torch.Generator().manual_seed(seed))
    return (starts + torch.arange(SEQ)) % VOCAB


class _Dicts(TensorDataset):
    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tensors[0][i]}


class CountingData(pl.LightningDataModule):
    """Train and validation splits of :func:`counting_sequences` (fixed seeds, no shuffling)."""

    def __init__(self, batch_size: int = 8, train: int = 512, val: int = 64) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.train_ids, self.val_ids = counting_sequences(train, seed=1), counting_sequences(val, seed=2)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(_Dicts(self.train_ids), batch_size=self.batch_size, shuffle=True,
                          generator=torch.Generator().manual_seed(0))

    def val_dataloader(self) -> DataLoader:
        return DataLoader(_Dicts(self.val_ids), batch_size=self.batch_size)


def make_module() -> GPT2Module:
    """A one-layer GPT-2 (32 wide, 2 heads, 64 tokens, 16 positions): 27k parameters."""
    return GPT2Module()


def make_datamodule() -> CountingData:
    """Batches of 8 sequences of 16 tokens."""
    return CountingData()
