"""The value of ``mp/grad_norm`` (unscaled global L2 norm of the gradients) in Lightning, against NumPy.

Two references per step, both computed here in float64 NumPy:

* the norm of the gradients the optimizer actually received (recorded by a callback placed after
  the monitor in ``on_before_optimizer_step``, where the plugin has unscaled them: the FP32
  masters' gradients under ``*-master``).  The monitor computes per-tensor float32 norms and the
  norm of those, so it may differ by ``(n + t) * u32`` relative (``n`` elements of the largest
  tensor, ``t`` tensors: the ``n*u`` bound of a float32 sum of squares);
* the exact gradient of the same loss on the same batch at the weights the forward used
  (a hand-written backward of Linear -> ReLU -> Linear + MSE).  The recipe's compute dtype rounds
  every dot product of the forward and backward passes; their lengths along the path sum to
  ``K = DIM + HIDDEN + BATCH + 8`` (input, weight, output and loss roundings), so the norms may differ
  by ``K * u`` relative (``u`` the compute dtype's unit roundoff).  A scaled norm (off by the loss
  scale, 2**8 here) or the norm of another step's gradients is far outside that.
"""

from __future__ import annotations

import math

import lightning.pytorch as pl
import numpy as np
import pytest
import torch

from lightning_ext import MixedPrecision, MixedPrecisionMonitor
from tests.lightning.helpers.models import TinyRegressor, loader, trainer_kwargs

DIM, HIDDEN, BATCH, STEPS = 8, 16, 8, 8
INF_STEP = 3  # 0-based global step whose loss is inf: an overflow, skipped by every recipe
UNIT = {"32-true": torch.float32, "16-mixed": torch.float16, "bf16-mixed": torch.bfloat16,
        "16-master": torch.float16, "bf16-master": torch.bfloat16}


class Recorder(pl.Callback):
    """Per step: the batch, the weights the forward used, and the gradients the optimizer received."""

    def __init__(self) -> None:
        self.batches, self.weights, self.grads = [], [], []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        x, y = batch
        self.batches.append((x.double().numpy(), y.double().numpy()))
        net = pl_module.net
        self.weights.append([t.detach().double().numpy().copy() for t in
                             (net[0].weight, net[0].bias, net[-1].weight, net[-1].bias)])

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        params = [p for g in optimizer.param_groups for p in g["params"]]
        self.grads.append([p.grad.detach().double().numpy().copy() for p in params if p.grad is not None])


def exact_grads(weights, x, y):
    """d/dparams of mean((relu(x W1^T + b1) W2^T + b2 - y)^2), float64."""
    w1, b1, w2, b2 = weights
    h = x @ w1.T + b1
    r = np.maximum(h, 0.0)
    out = r @ w2.T + b2
    dout = 2.0 * (out - y) / out.size
    dw2, db2 = dout.T @ r, dout.sum(axis=0)
    dh = (dout @ w2) * (h > 0)
    return [dh.T @ x, dh.sum(axis=0), dw2, db2]


def norm(arrays) -> float:
    return math.sqrt(sum(float(np.sum(np.square(a))) for a in arrays))


@pytest.mark.parametrize("recipe", list(UNIT))
def test_logged_grad_norm_is_the_unscaled_global_l2_norm(recipe):
    fp16 = UNIT[recipe] is torch.float16
    monitor = MixedPrecisionMonitor(log_every_n_steps=1, log_memory=False)
    recorder = Recorder()
    plugin = MixedPrecision(recipe, scaler={"init_scale": 2.0**8} if fp16 else None)
    model = TinyRegressor(inf_steps={INF_STEP}, optimizer="sgd", lr=0.05, dim=DIM, hidden=HIDDEN)
    trainer = pl.Trainer(plugins=[plugin], max_steps=STEPS, callbacks=[monitor, recorder], **trainer_kwargs())
    trainer.fit(model, loader(n=BATCH * STEPS, batch_size=BATCH, dim=DIM))

    records = list(monitor.history)
    assert [r.step for r in records] == list(range(1, STEPS + 1))
    assert len(recorder.grads) == len(recorder.weights) == STEPS
    largest = max(g.size for g in recorder.grads[0])
    tight = (largest + len(recorder.grads[0])) * torch.finfo(torch.float32).eps / 2
    loose = (DIM + HIDDEN + BATCH + 8) * torch.finfo(UNIT[recipe]).eps / 2
    checked = 0
    for k, record in enumerate(records):
        if k == INF_STEP:  # the overflow step: its unscaled gradients are not finite
            assert record.overflow and record.grad_norm is not None and not math.isfinite(record.grad_norm)
            continue
        assert not record.overflow, k
        actual = norm(recorder.grads[k])
        exact = norm(exact_grads(recorder.weights[k], *recorder.batches[k]))
        assert record.grad_norm == pytest.approx(actual, rel=tight, abs=0), (recipe, k)
        assert record.grad_norm == pytest.approx(exact, rel=loose, abs=0), (recipe, k, record.grad_norm, exact)
        checked += 1
    assert checked == STEPS - 1
    assert trainer.precision_plugin.loss_scaler.skipped == 1
    # the steps really differ, so a record of another step's gradients would have been caught
    norms = [r.grad_norm for k, r in enumerate(records) if k != INF_STEP]
    assert min(abs(a - b) / b for a, b in zip(norms, norms[1:])) > tight
