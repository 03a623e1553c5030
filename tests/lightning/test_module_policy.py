"""The op policy on torch modules: FP32 regions that torch.compile traces, base-class resolution, the report."""

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.plugins.precision import MixedPrecision as NativeMixedPrecision
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_ext import MixedPrecision
from lightning_ext.policy import apply_module_policy, policy_report
from mp_callbacks.policy import PrecisionPolicy


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.GELU(), nn.Linear(16, 1))


class Compiled(pl.LightningModule):
    def __init__(self, compile_net: bool) -> None:
        super().__init__()
        net = _net()
        self.net = torch.compile(net) if compile_net else net
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.net(x).float(), y)
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _fit(recipe: str, compile_net: bool) -> list[float]:
    g = torch.Generator().manual_seed(0)
    data = DataLoader(TensorDataset(torch.randn(32, 8, generator=g), torch.randn(32, 1, generator=g)), batch_size=8)
    model = Compiled(compile_net)
    pl.Trainer(plugins=[MixedPrecision(recipe)], max_steps=4, accelerator="cpu", logger=False,
               enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False).fit(model, data)
    return model.losses


def test_torch_compile_trains_like_eager():
    """A compiled submodule trains under bf16-master (the FP32 regions used to break compilation)."""
    compiled, eager = _fit("bf16-master", True), _fit("bf16-master", False)
    assert len(compiled) == len(eager) == 4
    # bf16 compute: compiled kernels may fuse and round differently; 4 steps stay within a few bf16 ulps
    for a, b in zip(compiled, eager, strict=True):
        assert abs(a - b) <= 16 * 2.0**-8 * abs(b), (compiled, eager)


@pytest.mark.parametrize("recipe", ["16-mixed", "bf16-mixed"])
def test_graph_breaks_equal_native(recipe):
    x = torch.randn(4, 8)
    native = NativeMixedPrecision(recipe, "cpu")
    with native.forward_context():
        expected = torch._dynamo.explain(_net())(x).graph_break_count
    ours = MixedPrecision(recipe)
    net = _net()
    handle = apply_module_policy(net, ours.policy, "cpu")
    assert handle.paths == ["1"]  # the LayerNorm is an FP32 region
    torch._dynamo.reset()
    with ours.forward_context():
        got = torch._dynamo.explain(net)(x).graph_break_count
    assert got == expected
    handle.remove()
    assert "forward" not in vars(net[1])


class RecordingNorm(nn.LayerNorm):
    """A LayerNorm subclass (resolves as layer_norm: FP32) that records what its forward sees."""

    seen: list = []

    def forward(self, x):
        RecordingNorm.seen.append((x.dtype, torch.is_autocast_enabled("cpu")))
        return super().forward(x)


def test_regions_run_fp32_and_are_removed():
    net = nn.Sequential(nn.Linear(8, 16), RecordingNorm(16))
    handle = apply_module_policy(net, PrecisionPolicy(compute="bfloat16"), "cpu")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert net(torch.randn(2, 8)).dtype == torch.float32
    assert RecordingNorm.seen[-1] == (torch.float32, False)  # FP32 inputs, autocast off inside
    handle.remove()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        net(torch.randn(2, 8))
    assert RecordingNorm.seen[-1] == (torch.bfloat16, True)


class MyLinear(nn.Linear):
    """A user's subclass: resolves as Linear."""


def test_subclasses_resolve_through_their_bases_and_the_report_says_why():
    attn = nn.MultiheadAttention(8, 2)
    model = nn.Sequential(MyLinear(8, 8), nn.LayerNorm(8))
    model.add_module("attn", attn)
    policy = MixedPrecision("bf16-master").policy
    assert policy.resolve(attn.out_proj, "attn.out_proj") == "bfloat16"  # NonDynamicallyQuantizableLinear
    rows = {r["path"]: r for r in policy_report(model, policy)}
    assert rows["0"]["compute"] == "bfloat16" and "a Linear" in rows["0"]["why"]
    assert rows["1"]["compute"] == "float32" and "FP32 op" in rows["1"]["why"]
    assert rows["attn.out_proj"]["compute"] == "bfloat16"
    ruled = policy.with_fp32_modules("Linear")  # an explicit rule still wins, and reaches subclasses
    assert ruled.resolve(MyLinear(2, 2)) == "float32"
    assert {r["path"]: r for r in policy_report(model, ruled)}["0"]["why"] == "module rule 'Linear'"


def test_monitor_prints_the_policy_report_on_request(capsys):
    from lightning_ext import MixedPrecisionMonitor

    monitor = MixedPrecisionMonitor(report_policy=True, log_memory=False)
    g = torch.Generator().manual_seed(0)
    data = DataLoader(TensorDataset(torch.randn(16, 8, generator=g), torch.randn(16, 1, generator=g)), batch_size=8)
    pl.Trainer(plugins=[MixedPrecision("bf16-master")], callbacks=[monitor], max_steps=1, accelerator="cpu",
               logger=False, enable_checkpointing=False, enable_progress_bar=False,
               enable_model_summary=False).fit(Compiled(False), data)
    event = next(e for e in monitor.history.events if e["kind"] == "policy")
    assert [r["storage"] for r in event["modules"] if r["path"] in ("net.0", "net.1")] == ["bfloat16", "float32"]


def test_hugging_face_gpt2_gelu_region_under_fp16_only():
    # The tanh GELU of transformers' GPT-2: no FP32 region under bf16-mixed (it follows autocast, as
    # native), an FP32 region under 16-mixed (x**3 leaves float16's range).
    transformers = pytest.importorskip("transformers")
    from lightning_ext.policy import fp32_compute_modules
    from mp_callbacks.recipes import get_recipe

    config = transformers.GPT2Config(vocab_size=32, n_positions=8, n_embd=16, n_layer=1, n_head=2)
    model = transformers.GPT2LMHeadModel(config)
    regions = {name: {type(m).__name__ for _, m in fp32_compute_modules(model, get_recipe(name).policy)}
               for name in ("bf16-mixed", "16-mixed")}
    assert "NewGELUActivation" not in regions["bf16-mixed"] and "LayerNorm" in regions["bf16-mixed"]
    assert "NewGELUActivation" in regions["16-mixed"]
