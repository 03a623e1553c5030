"""What an FP32 region around GPT-2's tanh GELU protects under bf16: final loss with and without it, against 32-true.

    python benchmarks/gelu_region_accuracy.py [--threads 1] [--steps 80] [--seeds 0 1]

bench_transformer.py's model (2 layers, d_model 128, seq 32, vocab 512, batch 8, AdamW lr 1e-3)
learns a counting sequence (each next token is the previous one plus a per-sequence stride, mod
vocab) through the Trainer under ``32-true``, ``bf16-mixed`` (the tanh GELU follows autocast, the
default since 2026-12-02) and ``bf16-mixed`` with ``NewGELUActivation`` declared float32 (an FP32
region, the default before).  ``--model hf`` trains Hugging Face's ``GPT2LMHeadModel`` from a config
of the same size instead.  Printed: the mean loss of the last
10 steps per run and its gap to 32-true of the same seed.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from bench_transformer_model import GPTConfig, TinyGPT, hf_gpt2, lm_loss  # noqa: E402
from common import machine_line  # noqa: E402
from profile_transformer import GELU_RULES, ours  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402


def counting_batches(cfg: GPTConfig, steps: int, batch: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        start = torch.randint(0, cfg.vocab, (batch, 1), generator=g)
        stride = torch.randint(1, 4, (batch, 1), generator=g)
        tokens = (start + stride * torch.arange(cfg.seq + 1)) % cfg.vocab
        out.append((tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()))
    return out


class LM(pl.LightningModule):
    def __init__(self, cfg: GPTConfig, seed: int, model: str = "tiny") -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.net = TinyGPT(cfg) if model == "tiny" else hf_gpt2(cfg)
        self.losses: list[float] = []

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        out = self.net(batch[0])
        loss = lm_loss(out.logits if hasattr(out, "logits") else out, batch[1])
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def main() -> None:
    import argparse
    import logging
    import warnings

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--model", choices=["tiny", "hf"], default="tiny")
    args = parser.parse_args()
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    torch.set_num_threads(args.threads)
    print(machine_line(args.threads))
    cfg = GPTConfig()
    runs = {"32-true": ours("32-true"), "bf16-mixed (GELU follows autocast)": ours("bf16-mixed"),
            "bf16-mixed, GELU in an FP32 region": ours("bf16-mixed", GELU_RULES)}
    for seed in args.seeds:
        batches = counting_batches(cfg, args.steps, 8, seed)
        finals = {}
        for name, make in runs.items():
            module = LM(cfg, seed, args.model)
            pl.Trainer(accelerator="cpu", devices=1, plugins=[make()], max_steps=args.steps, max_epochs=1,
                       logger=False, enable_checkpointing=False, enable_progress_bar=False,
                       enable_model_summary=False, num_sanity_val_steps=0).fit(
                module, train_dataloaders=DataLoader(batches, batch_size=None))
            finals[name] = sum(module.losses[-10:]) / 10
        ref = finals["32-true"]
        print(f"{args.model}, seed {seed}, {args.steps} steps, first loss {module.losses[0]:.4f}: " + "; ".join(
            f"{k} {v:.4f} ({v - ref:+.4f})" for k, v in finals.items()))


if __name__ == "__main__":
    main()
