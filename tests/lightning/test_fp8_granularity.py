"""``fp8-mixed`` at a finer granularity in Lightning (``fp8={"granularity": ...}``): rowwise, blockwise, MXFP8.

* The torch cast (lightning_ext.fp8.blocks) equals the core's NumPy reference cast
  (:func:`mp_callbacks.fp8.granularity.quantize`, itself bit for bit torchao's) for every kind, format,
  axis, rounding and shape, adversarial values included.
* One FP8 matmul: the output and both gradients equal a NumPy model in which each matmul casts its
  operands along its own contraction axis (``dx`` from ``W`` cast along ``out``, ``dW`` from ``x`` and
  ``dy`` cast along the tokens), within float32 summation order; ``weight_grad_hp`` keeps ``dW`` exact.
* Training: every kind trains the built-in task's MLP, a non-finite block skips the step like a
  per-tensor amax does, and the final loss stays close to ``bf16-master``'s.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from lightning_ext import MixedPrecision
from lightning_ext.fp8 import TorchFP8
from lightning_ext.fp8.blocks import block_cast
from mp_callbacks.fp8 import FP8Granularity, dequantize, quantize
from mp_callbacks.recipes import get_recipe
from tests.core.test_fp8_granularity import nonfinite, tensors
from tests.lightning.test_fp8 import Net, fit

KINDS = ("rowwise", "blockwise", "mxfp8")
DTYPES = {"float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}


def cases() -> dict[str, np.ndarray]:
    odd = np.random.default_rng(5).standard_normal((130, 300)).astype(np.float32)  # partial blocks both ways
    return {**tensors(), "nonfinite": nonfinite(), "odd": odd}


@pytest.mark.parametrize("settings", [{}, {"mx_rounding": "rceil"}, {"pow2_scales": False}], ids=str)
@pytest.mark.parametrize("kind", KINDS)
def test_the_torch_cast_is_the_core_reference(kind, settings):
    g = FP8Granularity(kind, **settings)
    for x in cases().values():
        for axis in (-1, 0):
            for weight in (False, True):
                for fmt, dtype in DTYPES.items():
                    q, inv, s = block_cast(torch.from_numpy(x), g, dtype, axis=axis, weight=weight)
                    rq, rs = quantize(x, kind, fmt, axis=axis, weight=weight, pow2_scales=g.rounds_to_pow2,
                                      mx_rounding=g.mx_rounding)
                    assert np.array_equal(q.float().numpy(), rq, equal_nan=True)
                    assert np.array_equal(s.numpy(), rs, equal_nan=True)


def qdq(x: np.ndarray, kind: str, fmt: str, axis: int, weight: bool = False) -> np.ndarray:
    return dequantize(*quantize(x, kind, fmt, axis=axis, weight=weight), kind, axis=axis, weight=weight)


@pytest.mark.parametrize("weight_grad_hp", [False, True])
@pytest.mark.parametrize("kind", KINDS)
def test_one_matmul_casts_each_operand_along_its_contraction(kind, weight_grad_hp):
    recipe = get_recipe("fp8-mixed", fp8={"granularity": {"kind": kind, "weight_grad_hp": weight_grad_hp}})
    fp8 = TorchFP8(recipe.fp8)
    torch.manual_seed(0)
    linear = nn.Linear(160, 48)
    fp8.install(nn.Sequential(linear), recipe.policy)
    x = (torch.randn(2, 70, 160) * torch.exp(torch.randn(1, 1, 160) * 2)).requires_grad_()  # outlier channels
    dy = torch.randn(2, 70, 48) * 1e-3
    y = linear(x)
    y.backward(dy)
    xn, wn, dyn = x.detach().numpy(), linear.weight.detach().numpy(), dy.numpy()
    e4, e5 = "float8_e4m3fn", "float8_e5m2"
    want_y = qdq(xn, kind, e4, -1) @ qdq(wn, kind, e4, -1, weight=True).T + linear.bias.detach().numpy()
    want_dx = qdq(dyn, kind, e5, -1) @ qdq(wn, kind, e4, 0, weight=True)
    x2, g2 = xn.reshape(-1, 160), dyn.reshape(-1, 48)
    want_dw = g2.T @ x2 if weight_grad_hp else qdq(g2, kind, e5, 0).T @ qdq(x2, kind, e4, 0)
    for name, got, want in (("y", y, want_y), ("dx", x.grad, want_dx), ("dw", linear.weight.grad, want_dw)):
        np.testing.assert_allclose(got.detach().numpy(), want, rtol=1e-5, atol=1e-5 * np.abs(want).max(),
                                   err_msg=name)
    assert torch.equal(linear.bias.grad, dy.reshape(-1, 48).sum(0))


@pytest.mark.parametrize("kind", KINDS)
def test_every_kind_trains_and_a_non_finite_block_skips_the_step(kind):
    plugin = MixedPrecision("fp8-mixed", fp8={"granularity": kind})
    model = Net(bad_steps={2})
    fit(plugin, model, steps=8)
    assert plugin.loss_scaler.skipped == 1  # the inf input's block, as with per-tensor scales
    assert plugin.recipe.fp8.granularity.kind == kind and plugin.recipe.fp8.mode == "current"
    assert [s["applied"] for s in model.seen].count(False) == 1


class LossNet(Net):
    """Net that keeps its training losses."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.losses.append(float(loss.detach()))
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx):
        if self.trainer.precision_plugin.fp8 is not None:
            super().on_train_batch_end(outputs, batch, batch_idx)


def test_granularity_trains_close_to_bf16_master():
    def losses(recipe: str, fp8=None) -> np.ndarray:
        model = LossNet(hidden=32, seed=3)
        model.losses = []
        fit(MixedPrecision(recipe, fp8=fp8), model, steps=30)
        return np.asarray(model.losses)

    ref = losses("bf16-master")
    assert ref[-5:].mean() < ref[:5].mean()  # it learns
    for kind in KINDS:
        got = losses("fp8-mixed", {"granularity": kind})
        assert abs(got[-5:].mean() - ref[-5:].mean()) <= 0.05 * ref[:5].mean(), (kind, got[-5:], ref[-5:])


def test_delayed_scaling_is_refused_with_a_finer_granularity():
    with pytest.raises(ValueError, match="mode must be 'current'"):
        MixedPrecision("fp8-mixed", fp8={"granularity": "rowwise", "mode": "delayed"})
