"""The torch models and data of the benchmarks.

* :class:`TinyGPT` (``--model tiny``): the transformer benchmark model, a GPT-2-style language model written the
  way Hugging Face writes GPT-2: token and position embeddings, pre-LayerNorm blocks with causal self-attention
  (``scaled_dot_product_attention``) and an MLP whose activation is a module of plain tensor ops
  (:class:`NewGELUActivation`, GPT-2's tanh GELU: a module the op policy does not know), a final LayerNorm and an
  untied output head.
* :func:`hf_gpt2` (``--model hf``): Hugging Face's ``GPT2LMHeadModel`` built from a ``GPT2Config`` of the same size
  (random init, no dropout, nothing downloaded).
* :func:`mlp` and :func:`digits`: a small classifier on scikit-learn's digits (the update-rule and FP8 training
  comparisons).

Every model returns logits (:class:`Logits` unwraps Hugging Face's output); :func:`lm_loss` is computed in FP32.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn

MODELS = ("tiny", "hf")


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    vocab: int = 512
    seq: int = 32
    d_model: int = 128
    heads: int = 4
    layers: int = 2
    ff: int = 512

    @classmethod
    def sized(cls, d_model: int = 128, layers: int = 2, seq: int = 32, vocab: int = 512) -> GPTConfig:
        """A config with ``heads = max(1, d_model // 32)`` and ``ff = 4 * d_model``."""
        return cls(vocab=vocab, seq=seq, d_model=d_model, heads=max(1, d_model // 32), layers=layers, ff=4 * d_model)


class NewGELUActivation(nn.Module):
    """GPT-2's GELU, tanh approximation, as ``transformers.activations.NewGELUActivation`` computes it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.c_attn = nn.Linear(d_model, 3 * d_model)
        self.c_proj = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.c_attn(x).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(b, t, d))


class MLP(nn.Module):
    def __init__(self, d_model: int, ff: int) -> None:
        super().__init__()
        self.c_fc = nn.Linear(d_model, ff)
        self.act = NewGELUActivation()
        self.c_proj = nn.Linear(ff, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.act(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg.d_model, cfg.heads)
        self.ln_2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg.d_model, cfg.ff)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class TinyGPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab, cfg.d_model)
        self.wpe = nn.Embedding(cfg.seq, cfg.d_model)
        self.h = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


class Logits(nn.Module):
    """A Hugging Face model that returns its ``logits`` (its output object otherwise)."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        out = self.net(idx)
        return getattr(out, "logits", out)


def hf_gpt2(cfg: GPTConfig) -> nn.Module:
    """Hugging Face's GPT-2 LM head model from a config of ``cfg``'s size (random init, no dropout, SDPA attention
    where the installed version has it, no cache), wrapped to return its logits."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=cfg.vocab, n_positions=cfg.seq, n_embd=cfg.d_model, n_layer=cfg.layers,
                        n_head=cfg.heads, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)
    try:
        config._attn_implementation = "sdpa"
    except Exception:  # noqa: BLE001 - another transformers version: its default attention
        pass
    return Logits(GPT2LMHeadModel(config))


def build(model: str, cfg: GPTConfig, seed: int = 0) -> nn.Module:
    """``model`` (one of :data:`MODELS`) of ``cfg``'s size, its initial weights drawn from ``seed``."""
    torch.manual_seed(seed)
    if model == "tiny":
        return TinyGPT(cfg)
    if model == "hf":
        return hf_gpt2(cfg)
    raise ValueError(f"model must be one of {MODELS}, not {model!r}")


def token_batches(cfg: GPTConfig, steps: int, batch_size: int, seed: int = 0) -> list[tuple[torch.Tensor, ...]]:
    """``steps`` batches of (inputs, next-token targets): random tokens, the same for every run."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        tokens = torch.randint(0, cfg.vocab, (batch_size, cfg.seq + 1), generator=g)
        out.append((tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()))
    return out


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy, in FP32."""
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def mlp(hidden: int = 256, depth: int = 2, inputs: int = 64, classes: int = 10, seed: int = 0) -> nn.Sequential:
    """``inputs`` -> ``depth`` x (Linear(hidden), ReLU) -> Linear(classes), initial weights from ``seed``."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    width = inputs
    for _ in range(depth):
        layers += [nn.Linear(width, hidden), nn.ReLU()]
        width = hidden
    return nn.Sequential(*layers, nn.Linear(width, classes))


def digits(steps: int, batch_size: int, seed: int = 0) -> tuple[list[tuple[torch.Tensor, torch.Tensor]],
                                                                   tuple[torch.Tensor, torch.Tensor]]:
    """scikit-learn's digits (pixels in [0, 1]): ``steps`` training batches drawn with ``seed`` (the same for every
    run) and the whole training set (to score a trained model)."""
    import numpy as np
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.from_numpy((data.data / 16.0).astype(np.float32))
    y = torch.from_numpy(data.target.astype(np.int64))
    rng = np.random.default_rng(seed)
    idx = [torch.from_numpy(rng.choice(len(x), batch_size, replace=False)) for _ in range(steps)]
    return [(x[i], y[i]) for i in idx], (x, y)
