"""Train a small MLP on scikit-learn's digits with ``lightning_ext.MixedPrecision``.

The data ships inside scikit-learn (no download).  Runs on CPU in seconds::

    python examples/lightning_digits.py                      # bf16-master
    python examples/lightning_digits.py --recipe 16-mixed --epochs 5
    python examples/lightning_digits.py --compare            # every recipe, one table

Prints the test accuracy, the loss-scaler counters and the dtypes the recipe
chose (parameters vs. the FP32 masters the optimizer holds).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from lightning_ext import MixedPrecision  # noqa: E402
from mp_callbacks import RECIPE_NAMES  # noqa: E402


class DigitsMLP(pl.LightningModule):
    """64 -> 128 -> LayerNorm -> GELU -> 10, AdamW with a cosine schedule."""

    def __init__(self, lr: float = 3e-3, total_steps: int = 1000) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 128), nn.LayerNorm(128), nn.GELU(), nn.Linear(128, 10))
        self.lr, self.total_steps = lr, total_steps
        self.correct = 0
        self.seen = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x).float(), y)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.correct += int((self(x).argmax(-1) == y).sum())
        self.seen += len(y)

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=1e-4)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=self.total_steps)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def digits_loaders(batch_size: int = 64, seed: int = 0) -> tuple[DataLoader, DataLoader]:
    """Standardised digits, 80/20 split."""
    x, y = load_digits(return_X_y=True)
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=0.2, random_state=seed, stratify=y)
    mean, std = x_tr.mean(0), x_tr.std(0) + 1e-6
    to_t = lambda a, b: TensorDataset(torch.tensor((a - mean) / std, dtype=torch.float32), torch.tensor(b))  # noqa: E731
    g = torch.Generator().manual_seed(seed)
    return (DataLoader(to_t(x_tr, y_tr), batch_size=batch_size, shuffle=True, generator=g),
            DataLoader(to_t(x_te, y_te), batch_size=256))


def run(recipe: str = "bf16-master", epochs: int = 10, seed: int = 0) -> dict[str, Any]:
    """Train and test one recipe; returns accuracy, scaler counters and dtypes."""
    pl.seed_everything(seed, verbose=False)
    train, test = digits_loaders(seed=seed)
    model = DigitsMLP(total_steps=epochs * len(train))
    plugin = MixedPrecision(recipe, "cpu")
    trainer = pl.Trainer(accelerator="cpu", devices=1, plugins=[plugin], max_epochs=epochs, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, train)
    trainer.test(model, test, verbose=False)
    counters = plugin.loss_scaler  # counts steps, overflows and skips under every recipe
    masters = plugin.master_state_dict()
    return {
        "recipe": recipe,
        "accuracy": model.correct / max(model.seen, 1),
        "scale": trainer.scaler.get_scale() if trainer.scaler is not None else None,  # None: nothing is scaled
        "steps": counters.steps,
        "overflows": counters.overflows,
        "skipped": counters.skipped,
        "param_dtypes": sorted({str(p.dtype).replace("torch.", "") for p in model.parameters()}),
        "master_params": sum(m.numel() for m in masters.values()),
    }


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """Command line entry point; returns the result rows."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="bf16-master", choices=RECIPE_NAMES)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--compare", action="store_true", help="run every recipe")
    args = parser.parse_args(argv)
    torch.set_num_threads(min(4, torch.get_num_threads()))
    rows = [run(r, args.epochs) for r in (RECIPE_NAMES if args.compare else [args.recipe])]
    print(f"{'recipe':<12} {'acc':>6} {'scale':>8} {'steps':>6} {'ovf':>4} {'skip':>5} {'masters':>8}  params")
    for r in rows:
        scale = "-" if r["scale"] is None else f"{r['scale']:g}"
        print(f"{r['recipe']:<12} {r['accuracy']:6.3f} {scale:>8} {r['steps']:6d} {r['overflows']:4d} "
              f"{r['skipped']:5d} {r['master_params']:8d}  {','.join(r['param_dtypes'])}")
    return rows


if __name__ == "__main__":
    main()
