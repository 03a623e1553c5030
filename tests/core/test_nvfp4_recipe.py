"""NVFP4's recipe layer in the core (mp_callbacks.fp8.nvfp4_recipe, mp_callbacks.memory): one Linear's three matmuls
within a bound derived from the format, the step flag, the matmul SNR on outlier operands next to FP8's
granularities, the settings and the bytes of an NVFP4 copy.  The casts themselves: test_nvfp4.py."""

from __future__ import annotations

import numpy as np
import pytest

from mp_callbacks.fp8 import (
    TE_SIGNS,
    NVFP4ConfigError,
    NVFP4Recipe,
    matmul_snr_db,
    nvfp4_linear_reference,
    nvfp4_matmul_snr_db,
    nvfp4_operand,
    nvfp4_sr_key,
    outlier_operands,
    random_hadamard_transform,
    rht_signs,
)
from mp_callbacks.memory import nvfp4_tensor_bytes, nvfp4_transient_bytes
from mp_callbacks.weights import sr_key


def test_sr_keys_separate_operands_matmuls_and_steps():
    keys = {nvfp4_sr_key(0, m, t, op) for m in range(3) for t in range(3)
            for op in ("dgrad_grad_output", "wgrad_grad_output")}
    assert len(keys) == 18 and nvfp4_sr_key(0, 1, 2, "wgrad_grad_output") == sr_key(0, 3, 2)
    with pytest.raises(ValueError):
        nvfp4_sr_key(0, 0, 0, "forward_input")


# -- the Linear's three matmuls ------------------------------------------------------------------------


def _error_bound(a: np.ndarray, recipe: NVFP4Recipe, operand: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(dequantized, the operand as cast (transformed or not), elementwise error bound)`` of one operand: in
    scaled units an element is off by at most half the E2M1 spacing around it (nearest) or the whole spacing
    (stochastic), or by what the clip at 6 removed; a unit is ``s_block * s_tensor``."""
    dq, cast = nvfp4_operand(a, recipe, operand)
    tile = recipe.tile(operand)
    signs = recipe.signs if recipe.uses_rht(operand) else None
    base = random_hadamard_transform(a, signs) if signs is not None else a
    unit = np.repeat(np.repeat(cast.scales.astype(np.float64) * cast.tensor_scale, tile[0], 0), tile[1], 1)
    enc = np.repeat(np.repeat(cast.encode, tile[0], 0), tile[1], 1)
    mag = np.abs(base * enc[: a.shape[0], : a.shape[1]].astype(np.float64))
    spacing = np.where(np.minimum(mag, 6) >= 4, 2.0, np.where(np.minimum(mag, 6) >= 2, 1.0, 0.5))
    per = np.maximum(spacing if recipe.uses_sr(operand) else spacing / 2, mag - 6)
    return dq, base, per * unit[: a.shape[0], : a.shape[1]]


def _product_bound(a, ea, b, eb, aq, bq):
    """|aq bq^T - a b^T| <= |ea||b|^T + |a||eb|^T + |ea||eb|^T, plus float32 accumulation of the quantized sum."""
    k = a.shape[1]
    return (np.abs(ea) @ np.abs(b).T + np.abs(a) @ np.abs(eb).T + ea @ eb.T
            + k * 2.0**-24 * (np.abs(aq) @ np.abs(bq).T)) * (1 + 1e-9)


@pytest.mark.parametrize("settings", [{}, {"rht": False, "stochastic_rounding": False, "weights_2d": False},
                                      {"scale_rule": "torchao", "rht_seed": 9}], ids=["te", "plain", "torchao"])
def test_linear_reference_within_the_format_bound(settings):
    recipe = NVFP4Recipe.coerce(settings)
    rng = np.random.default_rng(8)
    x = rng.standard_normal((2, 24, 64)).astype(np.float32)  # 48 tokens
    w = (rng.standard_normal((32, 64)) * 0.1).astype(np.float32)
    dy = rng.standard_normal((2, 24, 32)).astype(np.float32)
    out = nvfp4_linear_reference(x, w, dy, recipe, bias=np.ones(32, np.float32))
    x2, dy2 = x.reshape(-1, 64).astype(np.float64), dy.reshape(-1, 32).astype(np.float64)
    assert out["ok"] and np.array_equal(out["db"], dy.reshape(-1, 32).sum(0))
    checks = (("y", "forward_input", x2, "forward_weight", w, out["y"].reshape(48, 32) - 1),
              ("dx", "dgrad_grad_output", dy2, "dgrad_weight", w.T, out["dx"].reshape(48, 64)),
              ("dw", "wgrad_grad_output", dy2.T, "wgrad_input", x2.T, out["dw"]))
    for name, op_a, a, op_b, b, got in checks:
        a32, b32 = np.ascontiguousarray(a, np.float32), np.ascontiguousarray(b, np.float32)
        aq, ab, ea = _error_bound(a32, recipe, op_a)
        bq, bb, eb = _error_bound(b32, recipe, op_b)
        bound = _product_bound(ab, ea, bb, eb, aq, bq)
        err = np.abs(got.astype(np.float64) - a @ np.asarray(b, np.float64).T)
        assert np.all(err <= bound + 1e-30), (name, float((err / bound).max()))
        assert np.linalg.norm(err) / np.linalg.norm(a @ np.asarray(b, np.float64).T) < 0.25, name


def test_linear_reference_flags_a_nonfinite_gradient():
    rng = np.random.default_rng(9)
    x, w, dy = (rng.standard_normal(s).astype(np.float32) for s in ((16, 32), (16, 32), (16, 16)))
    assert nvfp4_linear_reference(x, w, dy)["ok"]
    dy[3, 4] = np.nan
    assert not nvfp4_linear_reference(x, w, dy)["ok"]


def test_snr_on_outlier_operands_next_to_fp8():
    """One mantissa bit instead of three: without outliers NVFP4 keeps ~11 dB less than every FP8
    granularity.  Outlier channels share a 1 x 16 block with ordinary ones and push them out of E2M1's
    range: NVFP4 sits below every FP8 kind, MXFP8 E4M3 included.  Outlier tokens: NVFP4's block scales
    keep what one FP8 scale per tensor loses, still below MXFP8 and a scale per row."""
    fp8 = ("tensorwise", "rowwise", "blockwise", "mxfp8")
    x, w = outlier_operands("channels", 1)
    snr = {k: matmul_snr_db(x, w, k) for k in fp8}
    assert min(snr.values()) - nvfp4_matmul_snr_db(x, w) > 9, snr
    x, w = outlier_operands("channels", 1e5)
    snr = {k: matmul_snr_db(x, w, k) for k in fp8}
    assert nvfp4_matmul_snr_db(x, w) < min(snr.values()), snr
    x, w = outlier_operands("tokens", 1e5)
    snr = {k: matmul_snr_db(x, w, k) for k in fp8}
    assert snr["tensorwise"] + 3 < nvfp4_matmul_snr_db(x, w) < snr["mxfp8"] - 6, snr


# -- settings and memory ------------------------------------------------------------------------------


def test_recipe_settings():
    r = NVFP4Recipe()
    assert (r.block, r.weights_2d, r.rht, r.stochastic_rounding, r.keep_first_last_bf16) == (16, True, True, True, True)
    assert r.signs == TE_SIGNS and r.tile("forward_weight") == (16, 16) and r.tile("wgrad_input") == (1, 16)
    assert r.uses_rht("wgrad_input") and not r.uses_rht("forward_input") and r.uses_sr("dgrad_grad_output")
    custom = NVFP4Recipe.coerce({"rht_seed": 4, "sr_seed": 2, "weights_2d": False})
    assert NVFP4Recipe.from_dict(custom.to_dict()) == custom and custom.tile("dgrad_weight") == (1, 16)
    assert NVFP4Recipe.coerce("torchao").scale_rule == "torchao" and NVFP4Recipe.coerce(None) == r
    assert NVFP4Recipe(block=32, rht_seed=1).signs == rht_signs(1, 32)
    for bad in ({"block": 12}, {"block": 0}, {"block": 32}, {"rht_seed": -1}, {"sr_seed": 1.5},
                {"weights_2d": "yes"}, {"scale_rule": "cublas"}, {"keep_first_last_bf16": None}):
        with pytest.raises(NVFP4ConfigError):
            NVFP4Recipe.coerce(bad)
    with pytest.raises(NVFP4ConfigError, match="unknown"):
        NVFP4Recipe.coerce({"blocks": 16})
    with pytest.raises(NVFP4ConfigError):
        r.tile("bias")


def test_memory_of_an_nvfp4_copy():
    """4 bits per element, one E4M3 byte per block (partial blocks whole), 4 bytes of tensor scale."""
    assert nvfp4_tensor_bytes((128, 256)) == 128 * 256 // 2 + 128 * 16 + 4
    assert nvfp4_tensor_bytes((128, 256), tile_2d=True) == 128 * 256 // 2 + 8 * 16 + 4
    assert nvfp4_tensor_bytes((3, 20)) == 30 + 3 * 2 + 4 and nvfp4_tensor_bytes((3, 20), two_level=False) == 36
    t = nvfp4_transient_bytes((32, 64), (2, 24, 64))
    assert t["kept"] == (2 * nvfp4_tensor_bytes((32, 64), tile_2d=True)
                         + nvfp4_tensor_bytes((48, 64)) + nvfp4_tensor_bytes((64, 48)))
    assert t["working"] == 4 * (32 * 64 + 48 * 64) and nvfp4_transient_bytes((32, 64), (8, 64), emulated=False)[
        "working"] == 0
