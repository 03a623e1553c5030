"""keras_ext/policy/rebuild.py: a built model rebuilt with new variable dtypes keeps a tied embedding tied (the LM head
is the encoder's own ``ReversibleEmbedding``, called by the graph), whichever of the two the graph calls first;
the reference is the same model built under the recipe from the start (no rebuild)."""

from __future__ import annotations

import keras
import numpy as np
import pytest
from keras import ops

import keras_ext
from keras_ext.global_policy import core_policy
from keras_ext.policy import make_plan

VOCAB, WIDTH, SEQ = 11, 8, 5


@keras.saving.register_keras_serializable("tests_rebuild")
class Encoder(keras.layers.Layer):
    """A composite layer that builds its sublayers itself: a token embedding, then a dense block."""

    def __init__(self, vocab: int, width: int, **kwargs):
        super().__init__(**kwargs)
        self.vocab, self.width = vocab, width
        self.embed = keras.layers.ReversibleEmbedding(vocab, width, dtype=self.dtype_policy, name="embed")
        self.block = keras.layers.Dense(width, activation="relu", dtype=self.dtype_policy, name="block")

    def build(self, input_shape):
        self.embed.build(input_shape)
        self.block.build((*input_shape, self.width))

    def call(self, tokens):
        return self.block(self.embed(tokens))

    def get_config(self):
        return {**super().get_config(), "vocab": self.vocab, "width": self.width}


def tied_lm(sublayer_first: bool) -> keras.Model:
    """Tokens -> Encoder -> logits through the encoder's own embedding reversed (tied); ``sublayer_first``: the
    graph also calls the embedding on the tokens before the encoder (a residual of the raw embedding)."""
    tokens = keras.Input((SEQ,), dtype="int32")
    enc = Encoder(VOCAB, WIDTH, name="encoder")
    if sublayer_first:
        raw = enc.embed(tokens)
        h = keras.layers.Add(name="residual")([enc(tokens), raw])
    else:
        h = enc(tokens)
    return keras.Model(tokens, enc.embed(h, reverse=True), name="tied_lm")


def _dtypes(model):
    return [(v.path, keras.backend.standardize_dtype(v.dtype)) for v in model.weights]


@pytest.mark.parametrize("sublayer_first", [False, True])
def test_a_tied_embedding_stays_tied_when_the_model_is_rebuilt(sublayer_first):
    model = tied_lm(sublayer_first)  # built in FP32: bf16-master must rebuild it
    assert len(model.weights) == 3  # the embedding once, the block's kernel and bias
    keras_ext.set_global_policy("bf16-master")
    reference = tied_lm(sublayer_first)  # built under the recipe: nothing to rebuild
    reference = keras_ext.apply_policy(reference)
    rebuilt = keras_ext.apply_policy(model)
    keras_ext.set_global_policy("32-true")

    assert rebuilt is not model
    enc = rebuilt.get_layer("encoder")
    heads = [layer for layer in rebuilt.layers if isinstance(layer, keras.layers.ReversibleEmbedding)]
    assert heads == [enc.embed]  # the graph's head is the rebuilt encoder's own embedding, not a copy
    assert [d for _, d in _dtypes(rebuilt)] == [d for _, d in _dtypes(reference)]
    assert "bfloat16" in {d for _, d in _dtypes(rebuilt)}
    for old, new in zip(model.weights, rebuilt.weights, strict=True):
        np.testing.assert_array_equal(ops.convert_to_numpy(ops.cast(old, new.dtype)), ops.convert_to_numpy(new))

    for old, new in zip(reference.weights, rebuilt.weights, strict=True):
        old.assign(new)
    tokens = np.arange(2 * SEQ, dtype="int32").reshape(2, SEQ) % VOCAB
    np.testing.assert_array_equal(ops.convert_to_numpy(rebuilt(tokens)), ops.convert_to_numpy(reference(tokens)))


def test_the_keras_hub_gpt2_with_a_tied_head_rebuilds_with_its_weight_count():
    """The example of ``mpx compare --keras``: a keras_hub GPT-2 backbone whose LM head is its token embedding."""
    pytest.importorskip("keras_hub")
    from examples.compare_keras_hub import build_model

    model = build_model()
    keras_ext.set_global_policy("bf16-master")
    rebuilt = keras_ext.apply_policy(model)
    keras_ext.set_global_policy("32-true")
    assert [v.path for v in rebuilt.weights] == [v.path for v in model.weights]
    import keras_hub

    # By type: Keras numbers a second backbone made in the same process "gpt2_backbone_1", ...
    (backbone,) = [layer for layer in rebuilt.layers if isinstance(layer, keras_hub.models.GPT2Backbone)]
    heads = [layer for layer in rebuilt.layers if isinstance(layer, keras.layers.ReversibleEmbedding)]
    assert heads == [backbone.token_embedding]
    rows = [r for r in make_plan(rebuilt, core_policy("bf16-master")) if r.layer is backbone.token_embedding]
    assert len(rows) == 2 and len({r.params for r in rows}) == 1  # its two uses, one decision
    assert keras.backend.standardize_dtype(backbone.token_embedding.embeddings.dtype) == rows[0].params
