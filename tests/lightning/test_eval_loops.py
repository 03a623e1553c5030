"""``trainer.validate`` / ``test`` / ``predict`` under every recipe equal Lightning's own plugins.

The reference for each recipe is Lightning's native plugin with the same compute dtype:
``precision="32-true"`` for ``32-true``, ``lightning.pytorch.plugins.MixedPrecision("16-mixed")``
for ``16-mixed`` and ``16-master``, ``MixedPrecision("bf16-mixed")`` for ``bf16-mixed`` and
``bf16-master``.  Under ``*-master`` the weights are stored in the low-precision dtype, which is
exactly what autocast rounds the native plugin's FP32 weights to before each matmul, so the same
kernels see the same operands.

Tolerance (dtype-derived): the outputs of ``Linear(d, h) -> ReLU -> Linear(h, 1)`` computed in a
format with unit roundoff ``u`` differ from the exact result by at most ``gamma * M`` with
``gamma = (d + h + 4) * u`` (the standard bound ``n*u`` for a length-``n`` dot product, plus the
roundings of input, weight, bias and output) and ``M = |W2| (|W1| |x| + |b1|) + |b2|`` (the
magnitude of the computation, in float64).  Two implementations may each be that far from the
exact result, so they may differ by ``2 * gamma * M``.  A forward that silently ran in FP32 instead
(no autocast in the eval loops) is caught by the output dtype.
"""

from __future__ import annotations

import copy

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.plugins.precision import MixedPrecision as NativeMixedPrecision

from lightning_ext import MixedPrecision
from tests.lightning.helpers.models import TinyRegressor, loader, trainer_kwargs

RECIPES = ["32-true", "16-mixed", "bf16-mixed", "16-master", "bf16-master"]
COMPUTE = {"32-true": torch.float32, "16-mixed": torch.float16, "bf16-mixed": torch.bfloat16,
           "16-master": torch.float16, "bf16-master": torch.bfloat16}
DIM, HIDDEN, N, BATCH = 8, 16, 32, 8


class EvalRegressor(TinyRegressor):
    """TinyRegressor with validation, test and predict steps (loss computed in FP32 from the output)."""

    def _loss(self, batch):
        x, y = batch
        return F.mse_loss(self(x).float(), y)

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self._loss(batch))

    def test_step(self, batch, batch_idx):
        self.log("test_loss", self._loss(batch))

    def predict_step(self, batch, batch_idx):
        return self(batch[0])


def _native_trainer(recipe: str, **kw) -> pl.Trainer:
    if recipe == "32-true":
        return pl.Trainer(precision="32-true", **trainer_kwargs(**kw))
    native = "16-mixed" if COMPUTE[recipe] is torch.float16 else "bf16-mixed"
    scaler = torch.amp.GradScaler("cpu") if native == "16-mixed" else None
    return pl.Trainer(plugins=[NativeMixedPrecision(native, "cpu", scaler)], **trainer_kwargs(**kw))


def _ours_trainer(recipe: str, **kw) -> pl.Trainer:
    # fp16: an initial scale of 2**8 (the torch preset's 2**16 overflows this model's fp16 gradients now and then)
    scaler = {"init_scale": 2.0**8} if recipe.startswith("16-") else None
    return pl.Trainer(plugins=[MixedPrecision(recipe, scaler=scaler)], **trainer_kwargs(**kw))


def _eval_all(trainer: pl.Trainer, model: pl.LightningModule) -> dict:
    data = loader(N, BATCH, DIM)
    val = trainer.validate(model, data, verbose=False)[0]["val_loss"]
    test = trainer.test(model, data, verbose=False)[0]["test_loss"]
    preds = trainer.predict(model, data)
    return {"val": val, "test": test, "pred": torch.cat(preds), "dtype": preds[0].dtype}


def _bound(model: torch.nn.Module, dtype: torch.dtype) -> torch.Tensor:
    """``2 * gamma * M`` per output row (see the module docstring), from the model's current weights."""
    u = torch.finfo(dtype).eps / 2
    lin1, lin2 = model.net[0], model.net[-1]
    x = torch.cat([b[0] for b in loader(N, BATCH, DIM)]).double()
    with torch.no_grad():
        h = x.abs() @ lin1.weight.double().abs().T + lin1.bias.double().abs()
        m = h @ lin2.weight.double().abs().T + lin2.bias.double().abs()
    return 2 * (DIM + HIDDEN + 4) * u * m


def _loss_bound(pred: torch.Tensor, pred_bound: torch.Tensor) -> float:
    """How far an MSE can move when each prediction moves by at most ``pred_bound``:
    ``|(p + e - y)^2 - (p - y)^2| <= (2 |p - y| + |e|) |e|``, averaged (plus FP32 rounding of the mean)."""
    y = torch.cat([b[1] for b in loader(N, BATCH, DIM)]).double()
    err = (2 * (pred.double() - y).abs() + pred_bound) * pred_bound
    return float(err.mean()) + 4 * torch.finfo(torch.float32).eps * float(((pred.double() - y) ** 2).mean())


def _assert_matches(ours: dict, native: dict, bound: torch.Tensor, recipe: str) -> None:
    assert ours["dtype"] == native["dtype"] == COMPUTE[recipe], (recipe, ours["dtype"], native["dtype"])
    diff = (ours["pred"].double() - native["pred"].double()).abs()
    assert (diff <= bound).all(), (recipe, float(diff.max()), float(bound.min()))
    tol = _loss_bound(native["pred"], bound)
    assert abs(ours["val"] - native["val"]) <= tol, (recipe, ours["val"], native["val"], tol)
    assert abs(ours["test"] - native["test"]) <= tol, (recipe, ours["test"], native["test"], tol)


@pytest.mark.parametrize("recipe", RECIPES)
def test_validate_test_predict_match_the_native_plugin(recipe):
    native_model, our_model = EvalRegressor(), EvalRegressor()  # same seed: same FP32 weights
    bound = _bound(native_model, COMPUTE[recipe])
    native = _eval_all(_native_trainer(recipe), native_model)
    trainer = _ours_trainer(recipe)
    ours = _eval_all(trainer, our_model)
    _assert_matches(ours, native, bound, recipe)
    # the loss each loop logged is the loss of the predictions that same precision produced
    y = torch.cat([b[1] for b in loader(N, BATCH, DIM)])
    per_batch = [F.mse_loss(p.float(), t) for p, t in zip(ours["pred"].split(BATCH), y.split(BATCH))]
    assert ours["val"] == pytest.approx(float(torch.stack(per_batch).mean()), rel=1e-6)
    # evaluation never steps the scaler (plugin.loss_scaler: present under every recipe)
    assert trainer.precision_plugin.loss_scaler.steps == 0


@pytest.mark.parametrize("recipe", RECIPES)
def test_fit_then_validate_uses_the_trained_weights(recipe):
    # an overflow step, skipped by every recipe (skip_nonfinite: nothing non-finite reaches the weights)
    model = EvalRegressor(inf_steps={1}, lr=5e-2)
    before = copy.deepcopy(model)
    trainer = _ours_trainer(recipe, max_epochs=1, check_val_every_n_epoch=1)
    trainer.fit(model, loader(N, BATCH, DIM), loader(N, BATCH, DIM))
    in_fit = float(trainer.callback_metrics["val_loss"])  # the validation run at the end of the epoch
    scaler = trainer.precision_plugin.loss_scaler
    steps = scaler.steps
    assert (steps, scaler.skipped) == (N // BATCH, 1)
    ours = _eval_all(trainer, model)
    assert ours["val"] == in_fit  # the same weights as the end-of-epoch validation
    assert scaler.steps == steps  # validate/test/predict after fit do not step the scaler
    # The reference: Lightning's plugin evaluating the trained weights.  Under *-master they are the
    # low-precision rounding of the FP32 masters, and widening them to FP32 is exact.
    trained = copy.deepcopy(model).float()
    native = _eval_all(_native_trainer(recipe), trained)
    _assert_matches(ours, native, _bound(trained, COMPUTE[recipe]), recipe)
    # training moved the weights, and ours evaluated the trained ones, not the initial ones: our
    # predictions are closer to the native evaluation of the trained weights than of the initial ones
    stale = _eval_all(_native_trainer(recipe), before.float())
    to_trained = (ours["pred"].double() - native["pred"].double()).abs().max()
    to_stale = (ours["pred"].double() - stale["pred"].double()).abs().max()
    assert to_trained < to_stale, (recipe, float(to_trained), float(to_stale))
    if recipe.endswith("-master"):
        masters = trainer.precision_plugin.master_state_dict()
        params = dict(model.named_parameters())
        assert masters and set(masters) <= set(params)
        for name, master in masters.items():  # the evaluated weights are the masters, rounded
            assert params[name].dtype == COMPUTE[recipe]
            assert torch.equal(params[name], master.to(COMPUTE[recipe])), name
