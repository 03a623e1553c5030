"""FP8 scaling granularity (mp_callbacks.fp8.granularity): the NumPy reference casts against torchao.

tensorwise and rowwise equal torchao's dynamic float8 cast (``hp_tensor_to_float8_dynamic``, the cast of
``Float8LinearConfig.from_recipe_name("tensorwise" / "rowwise")``) bit for bit, scales included; mxfp8 equals
``torchao.prototype.mx_formats.to_mx`` (FLOOR and RCEIL); blockwise equals the tensorwise cast applied to each
tile on its own.  Random and adversarial tensors: zeros, subnormals, outlier rows, inf and NaN.  And the reason
for finer scales, measured: on activations with a few outlier channels, rowwise/blockwise/MXFP8 keep the
matmul output far closer to FP32 than one scale per tensor once the outliers push the rest out of the
format's range.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from mp_callbacks.fp8 import FP8ConfigError, FP8Granularity, dequantize, matmul_snr_db, outlier_operands, quantize

torch = pytest.importorskip("torch")
pytest.importorskip("torchao")

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from torchao.float8.config import Float8LinearConfig, ScalingGranularity
    from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
    from torchao.float8.float8_training_tensor import LinearMMConfig
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.prototype.mx_formats.mx_tensor import to_mx

FORMATS = {"float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}


def tensors() -> dict[str, np.ndarray]:
    """Random and adversarial (8, 96) tensors: rows spread over many binades, zeros, subnormals, outliers."""
    rng = np.random.default_rng(0)
    wide = (rng.standard_normal((8, 96)) * np.exp(rng.uniform(-20, 20, (8, 1)))).astype(np.float32)
    adversarial = rng.standard_normal((8, 96)).astype(np.float32)
    adversarial[0] = 0.0                                    # an all-zero row (and MX blocks)
    adversarial[1, :40] = np.float32(1e-42)                 # float32 subnormals
    adversarial[2, 7] = 3e4                                 # one outlier in a row
    adversarial[3] *= 1e-30
    adversarial[4, 33] = np.float32(np.finfo(np.float32).max)
    return {"wide": wide, "adversarial": adversarial}


def nonfinite() -> np.ndarray:
    x = np.random.default_rng(1).standard_normal((4, 64)).astype(np.float32)
    x[1, 3], x[2, 40] = np.inf, np.nan
    return x


def torchao_cast(x: np.ndarray, fmt: str, axis: int | None, pow2: bool) -> tuple[np.ndarray, np.ndarray]:
    gran = ScalingGranularity.TENSORWISE if axis is None else ScalingGranularity.AXISWISE
    f = hp_tensor_to_float8_dynamic(torch.from_numpy(x), FORMATS[fmt], LinearMMConfig(), scaling_granularity=gran,
                                    axiswise_dim=axis, round_scales_to_power_of_2=pow2)
    return f._data.float().numpy(), f._scale.numpy()


def test_torchao_recipes_are_the_settings_compared():
    """The torchao recipes whose casts the anchors below reproduce: rowwise is axiswise e4m3 with
    power-of-two scales everywhere, tensorwise one dynamic scale without rounding."""
    rowwise = Float8LinearConfig.from_recipe_name("rowwise")
    assert rowwise.round_scales_to_power_of_2 and rowwise.cast_config_input.scaling_granularity is \
        ScalingGranularity.AXISWISE and rowwise.cast_config_grad_output.target_dtype == torch.float8_e4m3fn
    tensorwise = Float8LinearConfig.from_recipe_name("tensorwise")
    assert not tensorwise.round_scales_to_power_of_2
    assert tensorwise.cast_config_input.scaling_granularity is ScalingGranularity.TENSORWISE
    assert FP8Granularity("rowwise").rounds_to_pow2 and not FP8Granularity().rounds_to_pow2


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("case", ["wide", "adversarial"])
def test_tensorwise_equals_torchao(case, fmt):
    x = tensors()[case]
    q, s = quantize(x, "tensorwise", fmt)
    tq, ts = torchao_cast(x, fmt, None, False)
    assert np.array_equal(q, tq) and np.array_equal(s.reshape(()), ts)


@pytest.mark.parametrize("pow2", [True, False])
@pytest.mark.parametrize("axis", [-1, 0])
@pytest.mark.parametrize("case", ["wide", "adversarial"])
def test_rowwise_equals_torchao_along_either_axis(case, axis, pow2):
    x = tensors()[case]
    q, s = quantize(x, "rowwise", "float8_e4m3fn", axis=axis, pow2_scales=pow2)
    tq, ts = torchao_cast(x, "float8_e4m3fn", axis, pow2)
    assert np.array_equal(q, tq) and np.array_equal(s, ts)
    if pow2:  # a power of two: the mantissa bits are zero
        assert np.all((s.view(np.int32) & 0x7FFFFF) == 0)


@pytest.mark.parametrize("rounding,mode", [("floor", ScaleCalculationMode.FLOOR),
                                           ("rceil", ScaleCalculationMode.RCEIL)])
@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("case", ["wide", "adversarial", "nonfinite"])
def test_mxfp8_equals_torchao_to_mx(case, fmt, rounding, mode):
    x = nonfinite() if case == "nonfinite" else tensors()[case]
    exp, data = to_mx(torch.from_numpy(x).contiguous(), FORMATS[fmt], 32, mode)
    q, e = quantize(x, "mxfp8", fmt, mx_rounding=rounding)
    assert np.array_equal(e, exp.view(torch.uint8).numpy())
    assert np.array_equal(q, data.float().numpy(), equal_nan=True)


def test_blockwise_is_the_tensorwise_cast_of_each_tile():
    rng = np.random.default_rng(2)
    x = (rng.standard_normal((4, 300)) * np.exp(rng.uniform(-5, 5, (4, 300)))).astype(np.float32)
    q, s = quantize(x, "blockwise", axis=-1)  # 1 x 128 tiles, the last one 44 long (as zero padding)
    assert s.shape == (4, 3)
    for r in range(4):
        for b, sl in enumerate((slice(0, 128), slice(128, 256), slice(256, 300))):
            tq, ts = quantize(x[r, sl], "tensorwise", pow2_scales=True)
            assert np.array_equal(q[r, sl], tq) and s[r, b] == ts
    w = rng.standard_normal((200, 260)).astype(np.float32)
    wq, ws = quantize(w, "blockwise", weight=True, pow2_scales=False)  # 128 x 128 tiles
    assert ws.shape == (2, 3)
    tq, ts = quantize(w[128:, 256:], "tensorwise")
    assert np.array_equal(wq[128:, 256:], tq) and ws[1, 2] == ts
    assert np.array_equal(dequantize(wq, ws, "blockwise", weight=True), wq / np.repeat(np.repeat(
        ws, 128, 0), 128, 1)[:200, :260])


@pytest.mark.parametrize("kind", ["tensorwise", "rowwise", "blockwise", "mxfp8"])
def test_nonfinite_amax_marks_its_scale(kind):
    """A block holding inf or NaN casts to NaN (its scale is 0 or NaN; MX: exponent 255 for NaN) and no
    other block is touched: the adapters skip such a step as with per-tensor scales."""
    x = nonfinite()
    q, s = quantize(x, kind)
    bad_rows = {1, 2}
    if kind == "tensorwise":
        assert not np.all(np.isfinite(q))
        return
    assert np.isnan(q[2, 40])
    # inf: NaN where the scale is 0 (fmax / inf), saturated where an MX exponent bounds it (torchao's cast);
    # the adapters check every block's amax, so the step is skipped either way
    assert np.isnan(q[1, 3]) if kind != "mxfp8" else q[1, 3] == 448.0
    for r in range(x.shape[0]):
        if r not in bad_rows:
            assert np.all(np.isfinite(q[r])) and np.all(np.isfinite(s[r]))
    if kind == "mxfp8":
        assert (s == 255).sum() == 1


@pytest.mark.parametrize("kind", ["tensorwise", "rowwise", "blockwise", "mxfp8"])
def test_round_trip_error_is_bounded_by_the_format(kind):
    x = np.random.default_rng(3).standard_normal((8, 96)).astype(np.float32)
    q, s = quantize(x, kind)
    back = dequantize(q, s, kind)
    nonzero = np.abs(x) > 0
    rel = np.abs(back - x)[nonzero] / np.abs(x)[nonzero]
    assert np.median(rel) < 2.0**-4  # e4m3: 3 mantissa bits, half an ulp 2**-4 (subnormals aside)


def test_settings_refuse_bad_values():
    for bad in ({"kind": "channelwise"}, {"block": 0}, {"mx_rounding": "up"}, {"pow2_scales": "yes"}):
        with pytest.raises(FP8ConfigError):
            FP8Granularity(**bad)
    assert FP8Granularity.coerce("mxfp8").kind == "mxfp8"
    assert FP8Granularity.coerce({"kind": "rowwise", "weight_grad_hp": True}).weight_grad_hp


@pytest.mark.parametrize("case,ratio", [("channels", 1e5), ("tokens", 1e5)])
def test_finer_scales_keep_what_one_scale_per_tensor_loses(case, ratio):
    """The stress case of benchmarks/fp8_kinds.py: outlier features favour blocks along the
    contraction axis (MXFP8 > blockwise > rowwise > tensorwise); outlier tokens favour a scale per row."""
    x, w = outlier_operands(case, ratio)
    snr = {k: matmul_snr_db(x, w, k) for k in ("tensorwise", "rowwise", "blockwise", "mxfp8")}
    if case == "channels":
        assert snr["mxfp8"] > snr["blockwise"] > snr["rowwise"] > snr["tensorwise"], snr
        assert snr["mxfp8"] - snr["tensorwise"] > 6.0, snr  # more than 4x less error power
    else:
        assert min(snr["rowwise"], snr["blockwise"], snr["mxfp8"]) - snr["tensorwise"] > 15.0, snr


def test_at_100x_every_granularity_is_limited_by_the_mantissa():
    """Within e4m3's range (outliers 1000x) no value underflows: every kind keeps ~28 dB, within 1.5 dB."""
    x, w = outlier_operands("channels", 1e3)
    snr = [matmul_snr_db(x, w, k) for k in ("tensorwise", "rowwise", "blockwise", "mxfp8")]
    assert max(snr) - min(snr) < 1.5 and min(snr) > 25.0, snr


def test_scale_storage_per_granularity():
    """One float32 per tensor / row / block, one E8M0 byte per MX block of 32 (partial blocks count)."""
    from mp_callbacks.fp8 import fp8_transient_bytes, scale_bytes

    assert scale_bytes((300, 200)) == 4
    assert scale_bytes((300, 200), "rowwise") == 300 * 4
    assert scale_bytes((300, 200), "rowwise", axis=0) == 200 * 4
    assert scale_bytes((300, 200), "blockwise") == 300 * 2 * 4  # 1 x 128 tiles
    assert scale_bytes((300, 200), "blockwise", weight=True) == 3 * 2 * 4  # 128 x 128 tiles
    assert scale_bytes((300, 200), "mxfp8") == 300 * 7  # ceil(200 / 32) E8M0 bytes per row
    for kind in ("rowwise", "blockwise", "mxfp8"):  # the scales of every cast quantize() returns
        x = np.ones((70, 200), np.float32)
        for axis, weight in ((-1, False), (0, False), (-1, True)):
            s = quantize(x, kind, axis=axis, weight=weight)[1]
            assert scale_bytes(x.shape, kind, axis=axis, weight=weight) == s.size * s.itemsize
    t = fp8_transient_bytes(48 * 160, 150 * 160, shapes=((48, 160), (150, 160)), granularity="rowwise")
    assert t["kept"] == 2 * (48 * 160 + 150 * 160)  # the column-wise copies for the backward
    assert t["scales"] == 4 * (48 + 150 + 160 + 160)
