"""The same model, weights and batches in torch and in Keras.

Two architectures, each written once per framework with identical structure:

* ``mlp``: Dense(64->H) relu, Dense(H->H) relu, Dense(H->10).
* ``transformer``: the 64 digit pixels as 8 tokens of 8; Dense embed -> LayerNorm ->
  single-head softmax attention (q, k, v, out projections) -> residual ->
  LayerNorm -> MLP -> residual -> mean over tokens -> Dense head.

Weights are created in torch (seeded) and copied into Keras (kernels are the
transposed torch weights).  Batches come from scikit-learn's digits in a fixed
order.  Each batch carries a per-sample weight (1.0); on the steps of the
overflow schedule one weight is ``inf`` so the loss becomes inf in both
frameworks (Keras: ``sample_weight``; torch: the same weighted mean).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

TOKENS, TOKEN_DIM, CLASSES = 8, 8, 10


@dataclass(frozen=True)
class Batches:
    x: np.ndarray  # (steps, batch, 64) float32
    y: np.ndarray  # (steps, batch) int64
    w: np.ndarray  # (steps, batch) float32, inf on injected steps


def digits_batches(steps: int, batch: int, inject: tuple[int, ...] = (), seed: int = 0) -> Batches:
    """``steps`` batches from scikit-learn's digits, scaled to [0, 1], fixed order."""
    from sklearn.datasets import load_digits

    data = load_digits()
    x = (data.data / 16.0).astype(np.float32)
    y = data.target.astype(np.int64)
    rng = np.random.default_rng(seed)
    idx = np.concatenate([rng.permutation(len(x)) for _ in range(math.ceil(steps * batch / len(x)) + 1)])
    idx = idx[: steps * batch].reshape(steps, batch)
    w = np.ones((steps, batch), np.float32)
    for step in inject:
        w[step, 0] = np.inf
    return Batches(x=x[idx], y=y[idx], w=w)


# -- torch -----------------------------------------------------------------------------


def torch_model(kind: str, hidden: int = 32, seed: int = 0):
    """The torch version of ``kind`` (``mlp`` or ``transformer``), seeded."""
    import torch
    from torch import nn

    torch.manual_seed(seed)
    if kind == "mlp":
        return nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                             nn.Linear(hidden, CLASSES))
    if kind != "transformer":
        raise ValueError(f"unknown model kind {kind!r}; valid: mlp, transformer")

    class Attention(nn.Module):
        def __init__(self, d):
            super().__init__()
            self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
            self.softmax = nn.Softmax(dim=-1)
            self.d = d

        def forward(self, x):
            scores = self.q(x) @ self.k(x).transpose(-1, -2) / math.sqrt(self.d)
            return self.o(self.softmax(scores) @ self.v(x))

    class Block(nn.Module):
        def __init__(self, d):
            super().__init__()
            self.embed = nn.Linear(TOKEN_DIM, d)
            self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.attn = Attention(d)
            self.fc1, self.act, self.fc2 = nn.Linear(d, 2 * d), nn.ReLU(), nn.Linear(2 * d, d)
            self.head = nn.Linear(d, CLASSES)

        def forward(self, x):
            h = self.embed(x.reshape(x.shape[0], TOKENS, TOKEN_DIM))
            h = h + self.attn(self.norm1(h))
            h = h + self.fc2(self.act(self.fc1(self.norm2(h))))
            return self.head(h.mean(dim=1))

    return Block(hidden)


def torch_loss(logits, y, w):
    """Weighted mean cross-entropy (sum(l * w) / batch), computed in float32."""
    import torch

    losses = torch.nn.functional.cross_entropy(logits.float(), y, reduction="none")
    return (losses * w).sum() / w.shape[0]


# -- keras -----------------------------------------------------------------------------


def keras_model(kind: str, hidden: int = 32):
    """The Keras version of ``kind`` (weights to be copied from torch)."""
    import keras
    from keras import layers, ops

    inputs = keras.Input((64,))
    if kind == "mlp":
        h = layers.Dense(hidden, activation="relu", name="l0")(inputs)
        h = layers.Dense(hidden, activation="relu", name="l2")(h)
        out = layers.Dense(CLASSES, name="l4")(h)
        return keras.Model(inputs, out)
    if kind != "transformer":
        raise ValueError(f"unknown model kind {kind!r}; valid: mlp, transformer")
    d = hidden
    x = layers.Reshape((TOKENS, TOKEN_DIM))(inputs)
    h = layers.Dense(d, name="embed")(x)
    n1 = layers.LayerNormalization(epsilon=1e-5, name="norm1")(h)
    q = layers.Dense(d, name="attn_q")(n1)
    k = layers.Dense(d, name="attn_k")(n1)
    v = layers.Dense(d, name="attn_v")(n1)
    scores = layers.Lambda(lambda t: ops.matmul(t[0], ops.transpose(t[1], (0, 2, 1))) / math.sqrt(d),
                           name="attn_scores")([q, k])
    probs = layers.Softmax(axis=-1, name="attn_softmax")(scores)
    ctx = layers.Lambda(lambda t: ops.matmul(t[0], t[1]), name="attn_ctx")([probs, v])
    h = layers.Add()([h, layers.Dense(d, name="attn_o")(ctx)])
    n2 = layers.LayerNormalization(epsilon=1e-5, name="norm2")(h)
    m = layers.Dense(d, name="fc2")(layers.Dense(2 * d, activation="relu", name="fc1")(n2))
    h = layers.Add()([h, m])
    pooled = layers.GlobalAveragePooling1D()(h)
    out = layers.Dense(CLASSES, name="head")(pooled)
    return keras.Model(inputs, out)


# torch parameter-owning module path -> Keras layer name
TRANSFORMER_LAYERS = {
    "embed": "embed", "norm1": "norm1", "norm2": "norm2", "attn.q": "attn_q", "attn.k": "attn_k",
    "attn.v": "attn_v", "attn.o": "attn_o", "fc1": "fc1", "fc2": "fc2", "head": "head",
}
MLP_LAYERS = {"0": "l0", "2": "l2", "4": "l4"}


def layer_map(kind: str) -> dict[str, str]:
    return MLP_LAYERS if kind == "mlp" else TRANSFORMER_LAYERS


def torch_weights_in_keras_order(torch_module, kind: str) -> list[np.ndarray]:
    """torch parameters as Keras weights: [kernel.T or gamma, bias or beta] per layer."""
    modules = dict(torch_module.named_modules())
    out = []
    for path in layer_map(kind):
        m = modules[path]
        w = m.weight.detach().float().cpu().numpy()
        out.append(w.T.copy() if w.ndim == 2 else w.copy())
        out.append(m.bias.detach().float().cpu().numpy().copy())
    return out


def keras_weights_in_order(keras_model_, kind: str) -> list[np.ndarray]:
    """Keras weights in the order of :func:`torch_weights_in_keras_order`."""
    out = []
    for name in layer_map(kind).values():
        layer = keras_model_.get_layer(name)
        out.extend(np.asarray(v.numpy() if hasattr(v, "numpy") else v, dtype=np.float32)
                   for v in (w.value for w in layer.weights))
    return out


def copy_torch_to_keras(torch_module, keras_model_, kind: str) -> None:
    """Set the Keras model's weights to the torch model's (cast to each variable's dtype)."""
    values = iter(torch_weights_in_keras_order(torch_module, kind))
    for name in layer_map(kind).values():
        layer = keras_model_.get_layer(name)
        for var in layer.weights:
            var.assign(next(values).astype(var.dtype if isinstance(var.dtype, str) else "float32"))
