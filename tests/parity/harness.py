"""The same model, weights and batches in torch and in Keras.

Two architectures, each written once per framework with identical structure:

* ``mlp``: Dense(64->H) tanh, BlowUp, Dense(H->H) tanh, Dense(H->10) ``head``.
* ``transformer``: the 64 digit pixels as 8 tokens of 8; Dense embed -> LayerNorm ->
  single-head softmax attention (q, k (no bias), v, out projections) -> residual ->
  LayerNorm -> MLP (fc1 tanh, BlowUp, fc2) -> residual -> mean over tokens -> Dense head.

Hidden activations are ``tanh``, not ReLU: a ReLU whose input lies within
rounding distance of 0 is on in one framework and off in the other, a discrete
event that Adam (which divides each coordinate's update by its own RMS gradient)
turns into lr-sized differences.  The key projection has no bias: softmax is
invariant to it, so its exact gradient is 0 and it would receive only rounding
noise (same amplification).  Both are properties of the model and the optimizer,
not of the mixed-precision machinery under test.

``BlowUp`` multiplies its input by a per-step factor (1.0 except on the blow-up
steps of the schedule): an unknown custom op, so both adapters run it in FP32;
the next Dense layer casts its output to the compute dtype, where 1e6 times an
activation exceeds float16's range (65504) and becomes inf.

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
    f: np.ndarray  # (steps,) float32: the BlowUp factor of each step (1.0 normally)


def digits_batches(steps: int, batch: int, inject: tuple[int, ...] = (), seed: int = 0,
                   blowup: dict[int, float] | None = None) -> Batches:
    """``steps`` batches from scikit-learn's digits, scaled to [0, 1], fixed order.

    ``inject``: steps whose first sample weight is inf (loss = inf).  ``blowup``:
    ``{step: factor}`` for the BlowUp layer (1.0 on every other step).
    """
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
    f = np.ones((steps,), np.float32)
    for step, factor in (blowup or {}).items():
        f[step] = factor
    return Batches(x=x[idx], y=y[idx], w=w, f=f)


# -- torch -----------------------------------------------------------------------------


def torch_model(kind: str, hidden: int = 32, seed: int = 0):
    """The torch version of ``kind`` (``mlp`` or ``transformer``), seeded."""
    import torch
    from torch import nn

    class BlowUp(nn.Module):
        """``x * factor``; ``factor`` is set per step (an unknown op: FP32 under every recipe)."""

        def __init__(self):
            super().__init__()
            self.factor = 1.0

        def forward(self, x):
            return x * self.factor

    torch.manual_seed(seed)
    if kind == "mlp":
        class MLP(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc0, self.fc1 = nn.Linear(64, hidden), nn.Linear(hidden, hidden)
                self.head = nn.Linear(hidden, CLASSES)
                self.act0, self.blowup, self.act1 = nn.Tanh(), BlowUp(), nn.Tanh()

            def forward(self, x):
                return self.head(self.act1(self.fc1(self.blowup(self.act0(self.fc0(x))))))

        return MLP()
    if kind != "transformer":
        raise ValueError(f"unknown model kind {kind!r}; valid: mlp, transformer")

    class Attention(nn.Module):
        def __init__(self, d):
            super().__init__()
            # No key bias: softmax is invariant to it (q.b_k is the same for every key),
            # so its exact gradient is 0 and it would only ever receive rounding
            # noise, which Adam normalizes into lr-sized steps whose direction
            # differs between frameworks.
            self.q, self.v, self.o = (nn.Linear(d, d) for _ in range(3))
            self.k = nn.Linear(d, d, bias=False)
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
            self.fc1, self.act, self.fc2 = nn.Linear(d, 2 * d), nn.Tanh(), nn.Linear(2 * d, d)
            self.blowup = BlowUp()
            self.head = nn.Linear(d, CLASSES)

        def forward(self, x):
            h = self.embed(x.reshape(x.shape[0], TOKENS, TOKEN_DIM))
            h = h + self.attn(self.norm1(h))
            h = h + self.fc2(self.blowup(self.act(self.fc1(self.norm2(h)))))
            return self.head(h.mean(dim=1))

    return Block(hidden)


def torch_loss(logits, y, w):
    """Weighted mean cross-entropy (sum(l * w) / batch), computed in float32."""
    import torch

    losses = torch.nn.functional.cross_entropy(logits.float(), y, reduction="none")
    return (losses * w).sum() / w.shape[0]


# -- keras -----------------------------------------------------------------------------


_KERAS_CLASSES: dict = {}


def keras_blowup_class():
    """The Keras ``BlowUp`` layer class: ``x * factor`` with a non-trainable float32 ``factor`` variable."""
    if "BlowUp" not in _KERAS_CLASSES:
        import keras
        from keras import ops

        class BlowUp(keras.layers.Layer):
            def build(self, input_shape):
                self.factor = self.add_weight(shape=(), initializer="ones", trainable=False, dtype="float32",
                                              name="factor")

            def call(self, x):
                return x * ops.cast(self.factor, x.dtype)

        _KERAS_CLASSES["BlowUp"] = BlowUp
    return _KERAS_CLASSES["BlowUp"]


def keras_attention_classes():
    """``AttnScores`` (q k^T / sqrt(d)) and ``AttnCtx`` (probs v): the attention matmuls as layers.

    Custom layers rather than ``Lambda``: ``keras_ext.apply_policy`` re-creates
    layers from their config when it must change their variable dtype, and a
    ``Lambda`` holding a Python lambda cannot be re-created in Keras' safe mode.
    """
    if "AttnScores" not in _KERAS_CLASSES:
        import keras
        from keras import ops

        class AttnScores(keras.layers.Layer):
            def call(self, inputs):
                q, k = inputs
                return ops.matmul(q, ops.transpose(k, (0, 2, 1))) / math.sqrt(q.shape[-1])

            def compute_output_shape(self, input_shape):
                return (input_shape[0][0], input_shape[0][1], input_shape[1][1])

        class AttnCtx(keras.layers.Layer):
            def call(self, inputs):
                return ops.matmul(inputs[0], inputs[1])

            def compute_output_shape(self, input_shape):
                return (input_shape[0][0], input_shape[0][1], input_shape[1][2])

        _KERAS_CLASSES["AttnScores"], _KERAS_CLASSES["AttnCtx"] = AttnScores, AttnCtx
    return _KERAS_CLASSES["AttnScores"], _KERAS_CLASSES["AttnCtx"]


def keras_model(kind: str, hidden: int = 32):
    """The Keras version of ``kind`` (weights to be copied from torch)."""
    import keras
    from keras import layers

    BlowUp = keras_blowup_class()
    inputs = keras.Input((64,))
    if kind == "mlp":
        h = layers.Dense(hidden, activation="tanh", name="fc0")(inputs)
        h = BlowUp(name="blowup")(h)
        h = layers.Dense(hidden, activation="tanh", name="fc1")(h)
        out = layers.Dense(CLASSES, name="head")(h)
        return keras.Model(inputs, out)
    if kind != "transformer":
        raise ValueError(f"unknown model kind {kind!r}; valid: mlp, transformer")
    d = hidden
    x = layers.Reshape((TOKENS, TOKEN_DIM))(inputs)
    h = layers.Dense(d, name="embed")(x)
    n1 = layers.LayerNormalization(epsilon=1e-5, name="norm1")(h)
    q = layers.Dense(d, name="attn_q")(n1)
    k = layers.Dense(d, use_bias=False, name="attn_k")(n1)
    v = layers.Dense(d, name="attn_v")(n1)
    AttnScores, AttnCtx = keras_attention_classes()
    scores = AttnScores(name="attn_scores")([q, k])
    probs = layers.Softmax(axis=-1, name="attn_softmax")(scores)
    ctx = AttnCtx(name="attn_ctx")([probs, v])
    h = layers.Add()([h, layers.Dense(d, name="attn_o")(ctx)])
    n2 = layers.LayerNormalization(epsilon=1e-5, name="norm2")(h)
    m = layers.Dense(2 * d, activation="tanh", name="fc1")(n2)
    m = layers.Dense(d, name="fc2")(BlowUp(name="blowup")(m))
    h = layers.Add()([h, m])
    pooled = layers.GlobalAveragePooling1D()(h)
    out = layers.Dense(CLASSES, name="head")(pooled)
    return keras.Model(inputs, out)


# torch parameter-owning module path -> Keras layer name
TRANSFORMER_LAYERS = {
    "embed": "embed", "norm1": "norm1", "norm2": "norm2", "attn.q": "attn_q", "attn.k": "attn_k",
    "attn.v": "attn_v", "attn.o": "attn_o", "fc1": "fc1", "fc2": "fc2", "head": "head",
}
MLP_LAYERS = {"fc0": "fc0", "fc1": "fc1", "head": "head"}


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
        if m.bias is not None:
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
    from keras import ops

    values = iter(torch_weights_in_keras_order(torch_module, kind))
    for name in layer_map(kind).values():
        layer = keras_model_.get_layer(name)
        for var in layer.weights:
            var.assign(ops.cast(ops.convert_to_tensor(next(values)), var.dtype))


# -- FP64 reference: the loss of given FP32 weights, and its rounding sensitivity --------------

# Where the forward pass rounds to the compute dtype, and how many times at most (in
# either framework), for every recipe (the head, LayerNorm, softmax, the token mean
# and BlowUp run in FP32 under every recipe; see runs.parity_policy):
#   * a low-precision Dense output: 2 (the matmul's output, then the bias add: Keras
#     rounds after each, torch's addmm once), also without bias (conservative);
#   * an attention score: 2 (matmul, then / sqrt(d)); a context q.k-weighted sum: 1;
#   * tanh, a residual add: 1; an FP32 result (LayerNorm, softmax) entering a
#     low-precision matmul: 1 (the cast);
#   * every low-precision weight: 1 (the cast of the FP32 value: autocast, or the
#     ``*-master`` copy).
ROUNDINGS_DENSE, ROUNDINGS_OP, ROUNDINGS_CAST = 2, 1, 1


def _split_params(kind: str, shapes: list[tuple[int, ...]], flat):
    """[T, n] flat Keras-order states -> {name: [T, *shape]} in Keras layout (kernels [in, out])."""
    names = []
    for path in layer_map(kind):
        if kind == "transformer" and path in ("norm1", "norm2"):
            names += [f"{path}.gamma", f"{path}.beta"]
        elif path == "attn.k":
            names += ["attn.k.kernel"]
        else:
            names += [f"{path}.kernel", f"{path}.bias"]
    if len(names) != len(shapes):
        raise ValueError(f"{kind}: {len(shapes)} weight arrays, expected {len(names)} ({names})")
    out, offset = {}, 0
    for name, shape in zip(names, shapes):
        n = int(np.prod(shape))
        out[name] = flat[:, offset:offset + n].reshape((flat.shape[0],) + tuple(shape))
        offset += n
    if offset != flat.shape[1]:
        raise ValueError(f"{kind}: states have {flat.shape[1]} values, the shapes {offset}")
    return out


def fp64_losses(kind: str, shapes: list[tuple[int, ...]], states: np.ndarray, x: np.ndarray, y: np.ndarray,
                w: np.ndarray, chunk: int = 50) -> tuple[np.ndarray, np.ndarray]:
    """Per step t: the FP64 loss of FP32 weights ``states[t]`` on batch t, and its rounding sensitivity.

    ``states``: [T, n] flat Keras-order FP32 weights (:func:`torch_weights_in_keras_order`
    layout, ``shapes`` the arrays' shapes); ``x``, ``y``, ``w``: [T, batch, ...] (BlowUp's
    factor is 1: pass clean steps only).  The model is :func:`torch_model`'s, written as
    a function of the weights and evaluated in float64 (exact for this purpose).

    The sensitivity ``S`` is ``sum_v n_v * sum_i |v_i * dL/dv_i|`` over the tensors ``v``
    that the compute dtype rounds, ``n_v`` times each (see the ROUNDINGS_* constants):
    to first order, perturbing every such element by a relative error of at most
    ``eps`` moves the loss by at most ``eps * S``, whatever the errors' signs (round to
    nearest, or TensorFlow's truncating bfloat16 MatMul).
    """
    import torch

    T = states.shape[0]
    losses, sens = np.empty(T), np.empty(T)
    for start in range(0, T, chunk):
        sl = slice(start, min(T, start + chunk))
        flat = torch.tensor(np.asarray(states[sl], np.float64))
        p = {k: v.clone().requires_grad_(True) for k, v in _split_params(kind, shapes, flat).items()}
        xb = torch.tensor(np.asarray(x[sl], np.float64))
        points: list = []

        def rounded(t, n):
            t.retain_grad()
            points.append((t, n))
            return t

        def dense(h, name, n=ROUNDINGS_DENSE):
            kernel = p[f"{name}.kernel"]  # [steps, in, out]; h: [steps, ..., in]
            out = torch.bmm(h.reshape(h.shape[0], -1, h.shape[-1]), kernel)
            if f"{name}.bias" in p:
                out = out + p[f"{name}.bias"][:, None, :]
            return rounded(out.reshape(h.shape[:-1] + kernel.shape[-1:]), n)

        if kind == "mlp":
            low = ("fc0", "fc1")
            h = rounded(torch.tanh(dense(xb, "fc0")), ROUNDINGS_OP)
            h = rounded(torch.tanh(dense(h, "fc1")), ROUNDINGS_OP)
            logits = dense(h, "head", n=0)
        else:
            low = ("embed", "attn.q", "attn.k", "attn.v", "attn.o", "fc1", "fc2")

            def norm(h, name):
                g, b = p[f"{name}.gamma"][:, None, None], p[f"{name}.beta"][:, None, None]
                mu, var = h.mean(-1, keepdim=True), h.var(-1, unbiased=False, keepdim=True)
                return rounded((h - mu) / torch.sqrt(var + 1e-5) * g + b, ROUNDINGS_CAST)

            tokens = xb.reshape(xb.shape[0], xb.shape[1], TOKENS, TOKEN_DIM)
            h0 = dense(tokens, "embed")
            n1 = norm(h0, "norm1")
            q, k, v = dense(n1, "attn.q"), dense(n1, "attn.k"), dense(n1, "attn.v")
            d = q.shape[-1]
            scores = rounded(q @ k.transpose(-1, -2) / math.sqrt(d), ROUNDINGS_DENSE)
            probs = rounded(torch.softmax(scores, dim=-1), ROUNDINGS_CAST)
            ctx = rounded(probs @ v, ROUNDINGS_OP)
            h1 = rounded(h0 + dense(ctx, "attn.o"), ROUNDINGS_OP)
            m = rounded(torch.tanh(dense(norm(h1, "norm2"), "fc1")), ROUNDINGS_OP)
            h2 = rounded(h1 + dense(m, "fc2"), ROUNDINGS_OP)
            logits = dense(h2.mean(dim=2), "head", n=0)
        yb = torch.tensor(np.asarray(y[sl]))
        wb = torch.tensor(np.asarray(w[sl], np.float64))
        ce = torch.nn.functional.cross_entropy(logits.reshape(-1, CLASSES), yb.reshape(-1), reduction="none")
        loss = (ce.reshape(yb.shape) * wb).sum(-1) / yb.shape[-1]
        loss.sum().backward()  # the steps are independent: d(sum)/d(step t's tensors) = d(loss_t)/d(...)
        s = torch.zeros(flat.shape[0], dtype=torch.float64)
        for t, n in points:
            if n:
                s += n * (t.detach() * t.grad).abs().reshape(t.shape[0], -1).sum(-1)
        for name, t in p.items():
            if name.rsplit(".", 1)[0] in low:
                s += ROUNDINGS_CAST * (t.detach() * t.grad).abs().reshape(t.shape[0], -1).sum(-1)
        losses[sl], sens[sl] = loss.detach().numpy(), s.numpy()
    return losses, sens
