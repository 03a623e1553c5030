"""The Keras models of the benchmarks: the transformer benchmark model and keras_hub's GPT-2 (the twins of
``torch_models.py``).

* ``tiny``: token and position ``Embedding``, pre-LayerNorm blocks with causal ``MultiHeadAttention`` and an
  MLP whose activation is a custom layer of plain ops (:class:`NewGELU`, GPT-2's tanh GELU: a layer the op
  policy does not know, so keras_ext runs it in FP32 unless a module rule declares it), a final
  ``LayerNormalization`` and an untied ``Dense`` head; inputs ``[tokens, positions]``.
* ``hf`` (or ``keras_hub``): ``keras_hub.models.GPT2Backbone`` built from a config of the same size (random init,
  ``dropout=0``; nothing downloaded) with the LM head tied to its token embedding, as ``GPT2CausalLM``
  does; inputs ``{"token_ids", "padding_mask"}``.

Both are built under whatever Keras dtype policy is current (the caller sets it).
"""

from __future__ import annotations

import math
from typing import Any

import keras
import numpy as np
from keras import ops

__all__ = ["MODELS", "NewGELU", "build_model", "token_data"]

MODELS = ("tiny", "hf")
"""``hf``: keras_hub's GPT-2 (the name the torch side uses for its Hugging Face model)."""


@keras.saving.register_keras_serializable(package="bench")
class NewGELU(keras.layers.Layer):
    """GPT-2's GELU (tanh approximation) as a layer of plain ops."""

    def call(self, x: Any) -> Any:
        return 0.5 * x * (1.0 + ops.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * ops.power(x, 3.0))))


def _tiny(vocab: int, seq: int, d: int, layers: int, heads: int) -> keras.Model:
    idx = keras.Input((seq,), dtype="int32")
    pos = keras.Input((seq,), dtype="int32")  # 0..seq-1 (an input, so the position embedding is trained)
    x = keras.layers.Embedding(vocab, d, name="wte")(idx)
    x = x + keras.layers.Embedding(seq, d, name="wpe")(pos)
    for i in range(layers):
        h = keras.layers.LayerNormalization(epsilon=1e-5, name=f"ln_1_{i}")(x)
        h = keras.layers.MultiHeadAttention(heads, d // heads, name=f"attn_{i}")(h, h, use_causal_mask=True)
        x = x + h
        h = keras.layers.LayerNormalization(epsilon=1e-5, name=f"ln_2_{i}")(x)
        h = keras.layers.Dense(4 * d, name=f"c_fc_{i}")(h)
        h = NewGELU(name=f"act_{i}")(h)
        x = x + keras.layers.Dense(d, name=f"c_proj_{i}")(h)
    x = keras.layers.LayerNormalization(epsilon=1e-5, name="ln_f")(x)
    return keras.Model([idx, pos], keras.layers.Dense(vocab, use_bias=False, name="lm_head")(x))


def _keras_hub(vocab: int, seq: int, d: int, layers: int, heads: int) -> keras.Model:
    import keras_hub

    backbone = keras_hub.models.GPT2Backbone(vocabulary_size=vocab, num_layers=layers, num_heads=heads,
                                             hidden_dim=d, intermediate_dim=4 * d, max_sequence_length=seq,
                                             dropout=0.0)
    inputs = {"token_ids": keras.Input((seq,), dtype="int32", name="token_ids"),
              "padding_mask": keras.Input((seq,), dtype="int32", name="padding_mask")}
    logits = backbone.token_embedding(backbone(inputs), reverse=True)  # the tied head of GPT2CausalLM
    return keras.Model(inputs, logits, name="gpt2_lm")


def build_model(model: str, vocab: int, seq: int, d: int, layers: int, heads: int = 4) -> keras.Model:
    """``model`` (one of :data:`MODELS`) of the given size, under the current Keras dtype policy."""
    if model == "tiny":
        return _tiny(vocab, seq, d, layers, heads)
    if model in ("hf", "keras_hub"):
        return _keras_hub(vocab, seq, d, layers, heads)
    raise ValueError(f"model must be one of {MODELS}, not {model!r}")


def token_data(model: str, vocab: int, seq: int, n: int, seed: int = 0) -> tuple[Any, np.ndarray]:
    """``(inputs, next-token targets)`` for ``n`` random-token sequences, in ``model``'s input layout."""
    tokens = np.random.default_rng(seed).integers(0, vocab, (n, seq + 1)).astype("int32")
    if model == "tiny":
        xs: Any = [tokens[:, :-1], np.tile(np.arange(seq, dtype="int32"), (n, 1))]
    else:
        xs = {"token_ids": tokens[:, :-1], "padding_mask": np.ones((n, seq), "int32")}
    return xs, tokens[:, 1:]
