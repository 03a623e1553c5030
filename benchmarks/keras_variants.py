"""Keras variants: one recipe, ours or native, ``model.fit`` on a ``keras_models`` model, as a harness variant.

* native: Keras' own global dtype policy (``float32``, ``mixed_float16``, ``mixed_bfloat16``) while the model is
  built, the user's ``AdamW``, wrapped in ``keras.optimizers.LossScaleOptimizer`` under ``mixed_float16`` (as
  ``model.compile`` would);
* ours: the model built in FP32, ``keras_ext.set_global_policy(recipe)`` + ``keras_ext.apply_policy(model)``, and
  ``keras_ext.master_optimizer(AdamW, recipe)``.

Both compile with ``jit_compile=False`` and the same loss; the user's AdamW is the same on both sides.  Whatever
the backend (``KERAS_BACKEND``): the TensorFlow default for the timings, torch for ``launches.py``'s counts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import keras
from harness import Variant
from keras import ops
from keras_models import build_model, token_data

import keras_ext

NATIVE_POLICY = {"32-true": "float32", "16-mixed": "mixed_float16", "bf16-mixed": "mixed_bfloat16"}


def model_and_optimizer(v: Variant, model: str, vocab: int, seq: int, d_model: int, layers: int,
                        seed: int = 0) -> tuple[keras.Model, keras.optimizers.Optimizer]:
    """The variant's compiled-to-be model and optimizer, initial weights drawn from ``seed``."""
    before = keras.config.dtype_policy()
    keras.utils.set_random_seed(seed)
    heads = max(1, d_model // 32)
    try:
        if v.side == "native":
            keras.config.set_dtype_policy(NATIVE_POLICY[v.recipe])
            net = build_model(model, vocab, seq, d_model, layers, heads)
            opt: Any = keras.optimizers.AdamW(1e-3)
            if v.recipe == "16-mixed":
                opt = keras.optimizers.LossScaleOptimizer(opt)
        else:
            keras.config.set_dtype_policy("float32")
            net = build_model(model, vocab, seq, d_model, layers, heads)
            keras_ext.set_global_policy(v.recipe)
            net = keras_ext.apply_policy(net)
            opt = keras_ext.master_optimizer(keras.optimizers.AdamW(1e-3), v.recipe)
    finally:
        keras.config.set_dtype_policy(before)
    return net, opt


class StepHooks(keras.callbacks.Callback):
    """``clock.begin()`` at ``on_train_batch_begin``, ``clock.end()`` at ``on_train_batch_end`` (after the loss is
    on the host, so the step has finished on every backend)."""

    def __init__(self, clock: Any) -> None:
        super().__init__()
        self.clock = clock

    def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
        self.clock.begin()

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        if logs and "loss" in logs:
            ops.convert_to_numpy(logs["loss"])
        self.clock.end()


def fit_build(v: Variant, model: str, vocab: int, seq: int, d_model: int, layers: int,
              batch_size: int) -> Callable[[Any], Callable[[], Any]]:
    """A harness variant: ``model.fit`` of ``clock.total`` steps of random-token batches."""
    def build(clock: Any) -> Callable[[], Any]:
        net, opt = model_and_optimizer(v, model, vocab, seq, d_model, layers)
        net.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                    jit_compile=False)
        xs, ys = token_data(model, vocab, seq, clock.total * batch_size)

        def train() -> None:
            net.fit(xs, ys, batch_size=batch_size, epochs=1, shuffle=False, verbose=0, callbacks=[StepHooks(clock)])
        return train
    return build
