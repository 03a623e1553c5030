"""Master weights: the user's optimizer steps the FP32 masters as torch wrote it, ``bf16-master`` keeps learning
where pure bf16 stalls (swamping), the op policy holds, and a later fit starts from the weights the user set."""

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_ext import MixedPrecision
from tests.lightning.helpers.models import TinyRegressor, loader, trainer_kwargs

N, DIM, STEPS, LR = 256, 16, 300, 3e-3


class Swamp(pl.LightningModule):
    """Linear least squares with weights starting at 1.0 and a target within +-0.15 of them.

    Full-batch SGD updates are lr * grad <= ~5e-4, below half a bf16 ulp of the
    weights (2**-9 ~ 2e-3 just under 1.0), so pure bf16 weights never change.
    """

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, 1, bias=False)
        nn.init.ones_(self.lin.weight)
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.lin(x).float(), y)
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR)


def _data() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, DIM, generator=g)
    w_star = 1.0 + 0.05 * torch.randn(DIM, 1, generator=g)
    return DataLoader(TensorDataset(x, x @ w_star), batch_size=N)


def _final_loss(model: Swamp) -> float:
    x, y = _data().dataset.tensors
    with torch.no_grad():
        return float(F.mse_loss(x @ model.lin.weight.float().T, y))


def _fit(**kwargs) -> Swamp:
    model = Swamp()
    pl.Trainer(max_steps=STEPS, **trainer_kwargs(**kwargs)).fit(model, _data())
    return model


def test_bf16_master_beats_swamping_and_tracks_fp32():
    fp32 = _fit(precision="32-true")
    pure = _fit(precision="bf16-true")  # Lightning's native pure bf16: no master weights
    master = _fit(plugins=[MixedPrecision("bf16-master")])
    start = fp32.losses[0]
    # pure bf16 stalls: every update rounds away, the loss stays where it started
    assert torch.equal(pure.lin.weight.float(), torch.ones(1, DIM))
    assert _final_loss(pure) > 0.95 * start
    # FP32 learns; bf16-master follows it.  Tolerance: the rounding of the
    # weights and inputs to bf16 adds at most 2% of the starting loss.
    assert _final_loss(fp32) < 0.1 * start
    assert abs(_final_loss(master) - _final_loss(fp32)) < 0.02 * start
    assert abs(master.losses[-1] - fp32.losses[-1]) < 0.02 * start
    assert master.lin.weight.dtype == torch.bfloat16


class Probe(nn.Module):
    """Records the dtype of its input and whether autocast was on inside it (an unknown custom op)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[torch.dtype, bool]] = []

    def forward(self, x):
        self.seen.append((x.dtype, torch.is_autocast_enabled("cpu")))
        return x


class PolicyModel(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.probe = Probe()
        self.head = nn.Linear(8, 1)
        self.lin_out: list[torch.dtype] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        h = self.lin(x)
        self.lin_out.append(h.dtype)
        h = self.probe(self.norm(h))
        return F.mse_loss(self.head(h).float(), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-3)


def _policy_fit(recipe: str) -> PolicyModel:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(16, 8, generator=g), torch.randn(16, 1, generator=g)
    model = PolicyModel()
    trainer = pl.Trainer(plugins=[MixedPrecision(recipe)], max_steps=2, **trainer_kwargs())
    trainer.fit(model, DataLoader(TensorDataset(x, y), batch_size=8))
    return model


def test_op_policy_mixed_runs_fp32_modules_without_autocast():
    model = _policy_fit("bf16-mixed")
    assert model.lin_out == [torch.bfloat16, torch.bfloat16]  # Linear: low precision via autocast
    assert model.probe.seen == [(torch.float32, False)] * 2  # unknown op: FP32 input, autocast off
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert model.probe._forward_pre_hooks == {}  # hooks removed at teardown


def test_op_policy_master_keeps_fp32_params_for_fp32_modules():
    model = _policy_fit("bf16-master")
    assert model.lin.weight.dtype == torch.bfloat16 and model.head.weight.dtype == torch.bfloat16
    assert model.norm.weight.dtype == torch.float32  # LayerNorm params stay FP32
    assert model.probe.seen == [(torch.float32, False)] * 2


def test_policy_module_rule_overrides():
    from mp_callbacks import PrecisionPolicy

    policy = PrecisionPolicy(params="bfloat16", compute="bfloat16").with_fp32_modules("head")
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(16, 8, generator=g), torch.randn(16, 1, generator=g)
    model = PolicyModel()
    plugin = MixedPrecision("bf16-master", policy=policy)
    pl.Trainer(plugins=[plugin], max_steps=1, **trainer_kwargs()).fit(
        model, DataLoader(TensorDataset(x, y), batch_size=8))
    assert model.head.weight.dtype == torch.float32 and model.lin.weight.dtype == torch.bfloat16
    assert set(plugin.master_state_dict()) == {"lin.weight", "lin.bias"}


def test_refit_uses_the_weights_the_user_set_not_stale_masters():
    model = TinyRegressor()
    plugin = MixedPrecision("bf16-master")
    pl.Trainer(plugins=[plugin], max_steps=2, **trainer_kwargs()).fit(model, loader())
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(0.5)
    plugin_masters_before = {k: v.clone() for k, v in plugin.master_state_dict().items()}
    trainer = pl.Trainer(plugins=[plugin], max_steps=1, **trainer_kwargs())
    model.lr = 0.0  # no movement: the weights must stay the user's 0.5
    trainer.fit(model, loader())
    for name, p in model.named_parameters():
        assert torch.all(p.float() == 0.5), name
    assert any(not torch.equal(v, plugin.master_state_dict()[k]) for k, v in plugin_masters_before.items())


class _Capture(pl.Callback):
    """Per applied step: the optimizer's parameters (the masters) before the step, their gradients, and the
    parameters after it."""

    def __init__(self) -> None:
        self.before: list[list[torch.Tensor]] = []
        self.grads: list[list[torch.Tensor]] = []
        self.after: list[list[torch.Tensor]] = []

    def on_train_start(self, trainer, pl_module) -> None:
        opt = trainer.optimizers[0]

        def params():
            return [p for g in opt.param_groups for p in g["params"]]

        def pre(optimizer, args, kwargs):
            self.before.append([p.detach().clone() for p in params()])
            self.grads.append([p.grad.detach().clone() for p in params()])

        def post(optimizer, args, kwargs):
            self.after.append([p.detach().clone() for p in params()])

        opt.register_step_pre_hook(pre)
        opt.register_step_post_hook(post)


@pytest.mark.parametrize("recipe", ["bf16-master", "16-master"])
@pytest.mark.parametrize("fused", [False, True], ids=["default", "fused=True"])
def test_the_masters_step_is_the_users_adamw_on_fp32_parameters(recipe, fused):
    """The user's optimizer steps the FP32 masters as torch wrote it: fed the gradients the masters received, an
    FP32 copy stepped by the same AdamW ends where the masters do, bit for bit; the weights are the rounded
    masters."""
    capture = _Capture()
    plugin = MixedPrecision(recipe, scaler={"init_scale": 2.0**8} if recipe.startswith("16") else None)
    model = TinyRegressor(optimizer="adam", fused=fused, norm=True)
    pl.Trainer(plugins=[plugin], callbacks=[capture], max_steps=6, **trainer_kwargs()).fit(model, loader())
    assert plugin.loss_scaler.skipped == 0 and len(capture.after) == 6
    assert all(p.dtype == torch.float32 for p in capture.before[0])
    ref = [nn.Parameter(p.clone()) for p in capture.before[0]]
    opt = torch.optim.Adam(ref, lr=model.lr, fused=fused or None)
    for grads, after in zip(capture.grads, capture.after, strict=True):
        for p, g in zip(ref, grads, strict=True):
            p.grad = g.clone()
        opt.step()
        for a, b in zip(after, ref, strict=True):
            assert torch.equal(a, b.detach())
    masters = plugin.master_state_dict()
    for name, p in model.named_parameters():  # the weights are the rounded masters
        if name in masters:
            assert p.dtype != torch.float32 and torch.equal(p, masters[name].to(p.dtype)), name
