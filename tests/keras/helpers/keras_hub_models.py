"""keras_hub backbones built from their configs (random init, nothing downloaded), three families in one model.

:func:`joint` puts a GPT-2, a BERT and a Llama backbone side by side on the same token inputs, each with
its own LM head and loss: one fit trains the three families (their parameters are disjoint, so each
family's updates are its own; a skipped step skips all three).  :func:`train` runs the steps the tests
and ``benchmarks/keras_hub_recipes.py`` compare: ours (``keras_ext`` under a recipe) against Keras' own
policies from the same initial weights (every recipe draws them in FP32).
"""

from __future__ import annotations

from typing import Any

import keras
import keras_hub
import numpy as np

import keras_ext

VOCAB, SEQ = 50, 8
FAMILIES = ("gpt2", "bert", "llama")
LOW_SCALE = 2.0**8  # fp16 recipes start here (2**16 overflows these models: skipped steps, not training)


def backbone(family: str, dropout: float = 0.0) -> keras.Model:
    """A tiny ``family`` backbone from its config (one layer, hidden 8; GPT-2 with ``dropout``)."""
    if family == "gpt2":
        return keras_hub.models.GPT2Backbone(vocabulary_size=VOCAB, num_layers=1, num_heads=2, hidden_dim=8,
                                             intermediate_dim=16, max_sequence_length=SEQ, dropout=dropout)
    if family == "bert":
        return keras_hub.models.BertBackbone(vocabulary_size=VOCAB, num_layers=1, num_heads=2, hidden_dim=8,
                                             intermediate_dim=16, max_sequence_length=SEQ, dropout=0.0)
    if family == "llama":
        return keras_hub.models.LlamaBackbone(vocabulary_size=VOCAB, num_layers=1, num_query_heads=2,
                                              num_key_value_heads=1, hidden_dim=8, intermediate_dim=16)
    if family == "gemma":
        return keras_hub.models.GemmaBackbone(vocabulary_size=VOCAB, num_layers=1, num_query_heads=2,
                                              num_key_value_heads=1, hidden_dim=8, intermediate_dim=16, head_dim=4)
    raise ValueError(family)


def joint(families: tuple[str, ...] = FAMILIES) -> keras.Model:
    """The backbones of ``families`` on shared token inputs, an LM head (``<family>_head``) each."""
    inputs = {name: keras.Input((SEQ,), dtype="int32", name=name)
              for name in ("token_ids", "padding_mask", "segment_ids")}
    outputs = {}
    for family in families:
        bb = backbone(family)
        h = bb({k: inputs[k] for k in bb.input})
        h = h["sequence_output"] if isinstance(h, dict) else h
        outputs[family] = keras.layers.Dense(VOCAB, name=f"{family}_head")(h)
    return keras.Model(inputs, outputs)


def batch(n: int = 4, seed: int = 0, families: tuple[str, ...] = FAMILIES) -> tuple[dict, dict]:
    """Token inputs and next-token targets."""
    tok = np.random.default_rng(seed).integers(1, VOCAB, size=(n, SEQ))
    x = {"token_ids": tok, "padding_mask": np.ones((n, SEQ), "int32"), "segment_ids": np.zeros((n, SEQ), "int32")}
    return x, {f: np.roll(tok, -1, axis=1) for f in families}


def losses(families: tuple[str, ...] = FAMILIES) -> dict[str, Any]:
    return {f: keras.losses.SparseCategoricalCrossentropy(from_logits=True) for f in families}


def backbones(model: keras.Model) -> dict[str, keras.Model]:
    """``family -> backbone`` of a :func:`joint` model."""
    return {layer.name.split("_backbone")[0]: layer for layer in model.layers if isinstance(layer, keras.Model)}


def build(recipe: str, seed: int = 0, families: tuple[str, ...] = FAMILIES) -> keras.Model:
    """``joint()`` under ``recipe`` (keras_ext) or under Keras' own policy ``"native:<name>"``, uncompiled."""
    keras.config.set_dtype_policy("float32")
    try:
        if recipe.startswith("native:"):
            keras.config.set_dtype_policy(recipe.split(":", 1)[1])
            keras.utils.set_random_seed(seed)
            return joint(families)
        keras_ext.set_global_policy(recipe)
        keras.utils.set_random_seed(seed)
        return keras_ext.apply_policy(joint(families))
    finally:
        keras.config.set_dtype_policy("float32")


def optimizer(recipe: str) -> Any:
    """AdamW; ours through ``master_optimizer`` (fp16: from :data:`LOW_SCALE`), Keras' own fp16 in its
    ``LossScaleOptimizer`` from the same scale."""
    inner = keras.optimizers.AdamW(1e-2)
    if recipe.startswith("native:"):
        return keras.optimizers.LossScaleOptimizer(inner, initial_scale=LOW_SCALE) if "float16" in recipe else inner
    scaler = {"init_scale": LOW_SCALE} if recipe.startswith("16-") else None
    return keras_ext.master_optimizer(inner, recipe, scaler=scaler)


def train(recipe: str, steps: int = 2, seed: int = 0, families: tuple[str, ...] = FAMILIES) -> tuple[Any, dict]:
    """Build, compile (eager: a traced step of three transformers costs ~15 s here), ``steps`` steps of 2,
    then the loss per family on the 4 examples: ``(model, {family: loss})``."""
    model = build(recipe, seed, families)
    model.compile(optimizer(recipe), losses(families), run_eagerly=True)
    x, y = batch(families=families)
    for i in range(steps):
        part = slice(2 * (i % 2), 2 * (i % 2) + 2)
        model.train_on_batch({k: v[part] for k, v in x.items()}, {k: v[part] for k, v in y.items()})
    result = model.evaluate(x, y, batch_size=len(x["token_ids"]), verbose=0, return_dict=True)
    return model, {f: float(result[f"{f}_loss"]) for f in families}


def native_of(recipe: str) -> str:
    """The Keras policy a recipe is compared with: ``float32``, ``mixed_float16`` or ``mixed_bfloat16``."""
    if recipe == "32-true":
        return "native:float32"
    return "native:mixed_float16" if recipe.startswith("16-") else "native:mixed_bfloat16"
