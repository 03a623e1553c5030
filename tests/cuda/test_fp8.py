"""``fp8-mixed`` through ``torch._scaled_mm`` matches the emulation within a stated bound.

On a GPU with FP8 tensor cores (compute capability >= 8.9) the plugin's FP8 forward matmul is
``torch._scaled_mm`` on the e4m3 operands; elsewhere it is the emulation: a float32 matmul of the
dequantized operands.  Both see the same FP8 operands (the quantization does not depend on the
matmul), so the products are exact in FP32 and only the accumulation order and the final rounding
to the output dtype differ.  The stated bound, per output element::

    |y_scaled_mm - y_emulated| <= 2**-8 * |y_emulated| + 2**-10 * (|x_q| @ |w_q|^T)

one bfloat16 rounding of the output (unit roundoff 2**-8) plus an accumulation error of 2**-10 of
the absolute-value product (cuBLAS' FP8 GEMM accumulates in FP32 with periodic promotion: about
2**-13 is expected; the bound leaves room).  Over a few training steps the two paths give the same
skip decisions, bit-identical FP8 states for the first layer's inputs (the data), and losses within
2% of each other.

CPU counterparts: tests/lightning/test_fp8.py (the emulation against the core's NumPy model).
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F

from lightning_ext import MixedPrecision
from tests.cuda.helpers import DEVICE, ON_CUDA, Net, cuda_only, fit, fp8_tensor_cores

pytestmark = cuda_only + [pytest.mark.skipif(ON_CUDA and not fp8_tensor_cores(), reason=(
    "needs FP8 tensor cores (compute capability >= 8.9) and torch._scaled_mm: the plugin emulates FP8 here"))]

ACC_BOUND = 2.0**-10
OUT_BOUND = 2.0**-8


@pytest.fixture
def scaled_mm_calls(monkeypatch):
    calls: list[tuple[int, ...]] = []
    if not hasattr(torch, "_scaled_mm"):
        return calls
    original = torch._scaled_mm

    def counting(a, b, *args, **kwargs):
        calls.append((a.shape[0], a.shape[1], b.shape[1]))
        return original(a, b, *args, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", counting)
    return calls


class _Emulate(pl.Callback):
    """On every training forward of each FP8 Linear: its output and the emulation of the same matmul,
    quantized with the plugin's own ``quantize`` (``record=False``: the state does not move)."""

    def __init__(self) -> None:
        self.rows: list[tuple[str, torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self._handles: list = []

    def on_train_start(self, trainer, pl_module) -> None:
        fp8 = trainer.precision_plugin.fp8
        for index, name in enumerate(fp8.names):
            module = pl_module.get_submodule(name)
            self._handles.append(module.register_forward_hook(self._hook(fp8, index, name)))

    def on_train_end(self, trainer, pl_module) -> None:
        for h in self._handles:
            h.remove()

    def _hook(self, fp8, index: int, name: str):
        def hook(module, args, out):
            x = args[0]
            dev = x.device.type
            if torch.is_autocast_enabled(dev):  # what fp8_linear hands the matmul
                x = x.to(torch.get_autocast_dtype(dev))
            with torch.no_grad(), torch.autocast(dev, enabled=False):
                xq, x_inv = fp8.quantize("inputs", index, x, record=False)
                wq, w_inv = fp8.quantize("weights", index, module.weight, record=False)
                xd, wd = xq.float() * x_inv, wq.float() * w_inv
                b = None if module.bias is None else module.bias.float()
                ref = F.linear(xd, wd, b)
                absprod = F.linear(xd.abs(), wd.abs(), None if b is None else b.abs())
            self.rows.append((name, out.detach().float(), ref, absprod))
        return hook


@pytest.mark.parametrize("fp8", [None, {"mode": "current"}], ids=["delayed", "current"])
def test_each_scaled_mm_output_is_the_emulation_within_the_bound(fp8, scaled_mm_calls):
    probe = _Emulate()
    plugin = MixedPrecision("fp8-mixed", device=DEVICE, fp8=fp8)
    fit(plugin, Net(), steps=4, callbacks=[probe])
    if ON_CUDA:  # every Linear is 16-aligned: all three took the tensor-core path, every forward
        assert len(scaled_mm_calls) == 3 * 4, scaled_mm_calls
    assert len(probe.rows) == 3 * 4
    worst = 0.0
    for name, got, ref, absprod in probe.rows:
        bound = OUT_BOUND * ref.abs() + ACC_BOUND * absprod
        err = (got - ref).abs()
        assert (err <= bound).all(), (name, float((err - bound).max()))
        worst = max(worst, float((err / absprod.clamp_min(1e-30)).max()))
    print(f"largest |scaled_mm - emulation| / (|x_q| @ |w_q|^T): {worst:.3g}")


def _losses_and_states(fp8, steps: int = 6) -> tuple[torch.Tensor, int, list, MixedPrecision]:
    states = []

    class Snap(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            s = trainer.precision_plugin.fp8.states["inputs"]
            states.append((s.amax_history[0].clone(), s.scale[0].clone()))

    plugin = MixedPrecision("fp8-mixed", device=DEVICE, fp8=fp8)
    model = Net(inf_steps={3})
    fit(plugin, model, steps=steps, callbacks=[Snap()])
    return torch.stack(model.losses).float().cpu(), plugin.loss_scaler.skipped, states, plugin


def _compare_paths(fp8, monkeypatch, scaled_mm_calls) -> None:
    fast_losses, fast_skipped, fast_states, _ = _losses_and_states(fp8)
    if ON_CUDA:
        assert scaled_mm_calls, "torch._scaled_mm never ran"
    if hasattr(torch, "_scaled_mm"):
        monkeypatch.delattr(torch, "_scaled_mm")  # the plugin's gate then takes the emulation
    emu_losses, emu_skipped, emu_states, _ = _losses_and_states(fp8)
    assert fast_skipped == emu_skipped == 1
    finite = torch.isfinite(emu_losses)
    torch.testing.assert_close(fast_losses[finite], emu_losses[finite], rtol=2e-2, atol=1e-4)
    for (ha, sa), (hb, sb) in zip(fast_states, emu_states, strict=True):  # the first layer's inputs are the data
        assert torch.equal(ha, hb) and torch.equal(sa, sb)


def test_training_through_scaled_mm_follows_the_emulation(monkeypatch, scaled_mm_calls):
    _compare_paths(None, monkeypatch, scaled_mm_calls)


def test_rowwise_scales_follow_the_emulation_too(monkeypatch, scaled_mm_calls):
    try:
        MixedPrecision("fp8-mixed", device=DEVICE, fp8={"granularity": "rowwise"})
    except Exception as exc:  # noqa: BLE001 - any refusal means the setting does not exist in this tree
        pytest.skip(f"FP8 granularity (rowwise scales) is not in this tree: {exc}")
    _compare_paths({"granularity": "rowwise"}, monkeypatch, scaled_mm_calls)
