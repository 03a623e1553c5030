"""state_dtype="8bit": Keras' AdamW8bit (keras_ext.weights) and Lightning's (torchao's AdamW8bit computing a torch
AdamW's step, lightning_ext's EightBitAdamW) on the same weights and gradients hold the same codes, scales and
weights, bit for bit."""

from __future__ import annotations

import keras
import numpy as np
import torch

from keras_ext.weights import AdamW8bit
from lightning_ext.weights import EightBitAdamW


def test_keras_and_lightning_8bit_states_are_the_same_on_the_same_gradients():
    rng = np.random.default_rng(5)
    p0 = rng.standard_normal((32, 256)).astype(np.float32)
    grads = [rng.standard_normal(p0.shape).astype(np.float32) * 10.0 ** -k for k in range(4)]
    tp = torch.nn.Parameter(torch.from_numpy(p0.copy()))
    topt = torch.optim.AdamW([tp], lr=1e-2, weight_decay=1e-2, eps=1e-8)
    eight_bit = EightBitAdamW(topt)
    kv = keras.Variable(p0.copy())
    kopt = AdamW8bit(learning_rate=1e-2, weight_decay=1e-2, epsilon=1e-8)
    kopt.build([kv])
    for g in grads:
        tp.grad = torch.from_numpy(g.copy())
        eight_bit.step()
        kopt.apply([keras.ops.convert_to_tensor(g)], [kv])
        st = topt.state[tp]
        mc, ms, _, vc, vs, _ = (keras.ops.convert_to_numpy(x) for x in kopt.state_of(kv))
        assert np.array_equal(mc, st["exp_avg"].codes.numpy()) and np.array_equal(vc, st["exp_avg_sq"].codes.numpy())
        assert np.array_equal(ms.view(np.uint32), st["exp_avg"].scale.numpy().view(np.uint32))
        assert np.array_equal(vs.view(np.uint32), st["exp_avg_sq"].scale.numpy().view(np.uint32))
        assert np.array_equal(keras.ops.convert_to_numpy(kv).view(np.uint32), tp.detach().numpy().view(np.uint32))
