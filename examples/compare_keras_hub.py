"""Factories for ``mpx compare --keras``: a keras_hub GPT-2 backbone built from its config (random init).

No weights are downloaded: ``keras_hub.models.GPT2Backbone(...)`` with tiny sizes, and a language-model
head tied to its token embedding (as ``GPT2CausalLM`` does).  The data is the same learnable synthetic
language as ``examples/compare_hf_gpt2.py`` (each sequence counts up from a random start)::

    mpx compare --keras examples.compare_keras_hub:build_model \\
        --data examples.compare_keras_hub:make_dataset --steps 40 --out keras_hub_report

``build_model`` returns a compiled functional model (AdamW, sparse cross-entropy on the logits,
next-token accuracy); ``make_dataset`` ``{"train": (x, y), "validation": (x, y), "batch_size": 8}``:
NumPy arrays that ``mpx compare`` cuts into batches of 8 (``--batch-size`` overrides it).
"""

from __future__ import annotations

from typing import Any

import keras
import keras_hub  # at import: mpx imports this module once, before it forks
import numpy as np

VOCAB, SEQ, BATCH = 50, 8, 8


def build_model(num_layers: int = 1, hidden_dim: int = 8) -> Any:
    """A one-layer GPT-2 backbone (8 wide, 2 heads, 50 tokens, 8 positions) with a tied LM head, compiled."""
    backbone = keras_hub.models.GPT2Backbone(vocabulary_size=VOCAB, num_layers=num_layers, num_heads=2,
                                             hidden_dim=hidden_dim, intermediate_dim=2 * hidden_dim,
                                             max_sequence_length=SEQ, dropout=0.0)
    inputs = {"token_ids": keras.Input((None,), dtype="int32", name="token_ids"),
              "padding_mask": keras.Input((None,), dtype="int32", name="padding_mask")}
    logits = backbone.token_embedding(backbone(inputs), reverse=True)
    model = keras.Model(inputs, logits, name="gpt2_lm")
    model.compile(optimizer=keras.optimizers.AdamW(learning_rate=3e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=[keras.metrics.SparseCategoricalAccuracy(name="accuracy")])
    return model


def counting_sequences(n: int, seed: int) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """``n`` inputs ``(s, s+1, ...) mod VOCAB`` with random starts ``s``, and the next tokens as targets."""
    starts = np.random.default_rng(seed).integers(0, VOCAB, (n, 1))
    tokens = ((starts + np.arange(SEQ + 1)) % VOCAB).astype("int32")
    x = {"token_ids": tokens[:, :-1], "padding_mask": np.ones((n, SEQ), "int32")}
    return x, tokens[:, 1:]


def make_dataset() -> dict[str, Any]:
    """512 training and 64 validation sequences, in batches of ``BATCH``."""
    return {"train": counting_sequences(512, seed=1), "validation": counting_sequences(64, seed=2),
            "batch_size": BATCH}
