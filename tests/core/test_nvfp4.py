"""NVFP4 in the core (mp_callbacks.fp8: fp4, nvfp4, hadamard, nvfp4_recipe): the NumPy reference against torchao.

The E2M1 rounding equals torchao's ``f32_to_f4_unpacked`` and the packing its ``pack_uint4``; the 1 x 16
two-level (and single-level) cast under ``scale_rule="torchao"`` equals ``nvfp4_quantize`` bit for bit
(packed codes, E4M3 scale bits, the tensor scale) and its dequantization ``NVFP4Tensor.dequantize``, on
random and adversarial operands (tests/core/nvfp4_cases.py).  Where torchao's arithmetic is not finite
(NaN/inf inputs, an all-zero tensor, a tensor scale whose reciprocal overflows) the blocks are flagged.
Then the properties the recipe relies on: the RHT's orthogonality and its cancellation in the matmul,
stochastic rounding unbiased and better than nearest on average, the Linear's three matmuls within a bound
derived from the format, and the matmul SNR on outlier operands next to FP8's granularities.  Transformer
Engine's reference is compared in test_nvfp4_te.py.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from mp_callbacks.fp8 import (
    E2M1_VALUES,
    FP4_CODE_VALUES,
    TE_SIGNS,
    NVFP4ConfigError,
    NVFP4Recipe,
    e4m3_bits,
    e4m3_from_bits,
    fp4_codes,
    fp4_round,
    fp4_values,
    hadamard_matrix,
    inverse_random_hadamard_transform,
    matmul_snr_db,
    nvfp4_dequantize,
    nvfp4_flushed_fraction,
    nvfp4_linear_reference,
    nvfp4_matmul_snr_db,
    nvfp4_operand,
    nvfp4_quantize,
    nvfp4_saturated_fraction,
    nvfp4_sr_key,
    outlier_operands,
    pack_fp4,
    random_hadamard_transform,
    rht_signs,
    unpack_fp4,
)
from mp_callbacks.memory import nvfp4_tensor_bytes, nvfp4_transient_bytes
from mp_callbacks.weights import sr_key

from .nvfp4_cases import TIES, cases, nonfinite_cases

torch = pytest.importorskip("torch")
pytest.importorskip("torchao")

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from torchao.prototype.mx_formats.kernels import f32_to_f4_unpacked, pack_uint4
    from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor, per_tensor_amax_to_scale
    from torchao.prototype.mx_formats.nvfp4_tensor import nvfp4_quantize as ao_quantize

CASES = cases()


def torchao_cast(x: np.ndarray, two_level: bool) -> tuple[np.ndarray | None, np.ndarray, np.ndarray]:
    """torchao's ``(per_tensor_scale, E4M3 scale bits, packed codes)`` of ``x``."""
    t = torch.from_numpy(x)
    pts = per_tensor_amax_to_scale(t.abs().max()) if two_level else None
    scales, packed = ao_quantize(t, 16, pts)
    return None if pts is None else pts.numpy(), scales.view(torch.uint8).numpy(), packed.numpy()


# -- the format --------------------------------------------------------------------------------------


def test_e2m1_values_codes_and_packing():
    assert E2M1_VALUES == (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
    codes = np.arange(16, dtype=np.uint8)
    assert np.array_equal(fp4_codes(fp4_values(codes)), codes)  # -0.0 is code 8
    assert np.signbit(FP4_CODE_VALUES[8]) and FP4_CODE_VALUES[15] == -6.0
    assert pack_fp4(np.array([[1, 2, 15, 8]], np.uint8)).tolist() == [[0x21, 0x8F]]  # low nibble first
    rng = np.random.default_rng(0)
    many = rng.integers(0, 16, (8, 64)).astype(np.uint8)
    assert np.array_equal(pack_fp4(many), pack_uint4(torch.from_numpy(many)).numpy())
    assert np.array_equal(unpack_fp4(pack_fp4(many)), many)
    with pytest.raises(ValueError):
        fp4_codes(np.array([2.5], np.float32))


def test_rounding_to_nearest_even_equals_torchao():
    """Every tie goes to the even code, saturation at 6, signed zeros kept: torchao's f32_to_f4_unpacked on
    200k random values, the ties and their float32 neighbours, subnormals, -0.0 and inf."""
    rng = np.random.default_rng(1)
    ties = np.concatenate([TIES, np.nextafter(TIES, 0), np.nextafter(TIES, 10)])
    x = np.concatenate([rng.uniform(-8, 8, 200_000), ties, -ties,
                        [0.0, -0.0, 1e-40, -1e-40, 7.0, -1e30, np.inf, -np.inf]]).astype(np.float32)
    ours = fp4_codes(fp4_round(x))
    theirs = f32_to_f4_unpacked(torch.from_numpy(np.clip(x, -6, 6))).numpy()
    assert np.array_equal(ours, theirs)
    assert fp4_round(TIES).tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0]
    assert fp4_round(np.array([np.nan], np.float32)).tolist() == [0.0]  # E2M1 has no NaN: the block is flagged


def test_e4m3_bits_of_every_pattern():
    values = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float().numpy()
    assert np.array_equal(e4m3_bits(values), np.arange(256, dtype=np.uint8))
    assert np.array_equal(e4m3_from_bits(np.arange(256)), values, equal_nan=True)


# -- the cast against torchao -------------------------------------------------------------------------


@pytest.mark.parametrize("two_level", [True, False], ids=["two_level", "single_level"])
@pytest.mark.parametrize("name", list(CASES))
def test_cast_equals_torchao_nvfp4_quantize(name, two_level):
    x = CASES[name]
    pts, scales, packed = torchao_cast(x, two_level)
    cast = nvfp4_quantize(x, rule="torchao", two_level=two_level)
    nan = (scales & 0x7F) == 0x7F  # a NaN scale (all-zero tensor): its sign bit is the platform's 0 / 0
    assert np.array_equal(np.isnan(cast.scales), nan) and np.array_equal(e4m3_bits(cast.scales)[~nan], scales[~nan])
    if pts is not None:
        assert cast.tensor_scale.dtype == np.float32 and np.array_equal(cast.tensor_scale, pts)
    if np.all(cast.finite):
        assert np.array_equal(pack_fp4(fp4_codes(cast.values)), packed)
    n = NVFP4Tensor.to_nvfp4(torch.from_numpy(x), per_tensor_scale=None if pts is None else torch.from_numpy(pts))
    assert np.array_equal(nvfp4_dequantize(cast, rule="torchao"), n.dequantize(torch.float32).numpy(), equal_nan=True)


def test_where_torchao_is_not_finite_the_blocks_are_flagged():
    """torchao's two-level cast of an all-zero tensor divides 0 by 0 (NaN scales, and codes of +-2 from its bit
    arithmetic on NaN), and of float32-subnormal inputs overflows 1 / per_tensor_scale: the
    torchao rule flags every block.  Transformer Engine's rule (the default) casts both to zeros."""
    pts, scales, packed = torchao_cast(CASES["zeros"], True)
    assert pts == 0 and np.all((scales & 0x7F) == 0x7F)
    assert np.all(unpack_fp4(packed) & 7 == 4)  # E2M1 +-2 from its bit arithmetic on NaN
    assert not np.any(nvfp4_quantize(CASES["zeros"], rule="torchao").finite)
    assert not np.all(nvfp4_quantize(CASES["subnormal_inputs"], rule="torchao").finite)
    for name in ("zeros", "subnormal_inputs"):
        te = nvfp4_quantize(CASES[name])
        assert np.all(te.finite) and np.all(te.values == 0)
        assert nvfp4_quantize(CASES[name], rule="torchao", two_level=False).finite.all()


@pytest.mark.parametrize("rule", ["transformer-engine", "torchao"])
@pytest.mark.parametrize("name", ["nan", "inf", "minus_inf"])
def test_a_nonfinite_input_flags_its_block(name, rule):
    """inf or NaN spoils the tensor amax, hence every block of a two-level cast; a single-level cast flags
    the block holding it only.  torchao: NaN makes the tensor scale NaN; inf makes it inf (finite blocks
    then cast to zeros, the inf block to a NaN scale).  ``ok = all(finite)``: the step is skipped."""
    x = nonfinite_cases()[name]
    two = nvfp4_quantize(x, rule=rule)
    assert not np.any(two.finite)
    if rule == "torchao":
        pts, scales, _ = torchao_cast(x, True)
        assert (np.isnan(pts) and np.all((scales & 0x7F) == 0x7F)) if name == "nan" else np.isinf(pts)
    one = nvfp4_quantize(x, rule=rule, two_level=False)
    expected = np.ones_like(one.finite)
    expected[2, 1] = False  # element (2, 20) is in block 1 of row 2
    assert np.array_equal(one.finite, expected)


def test_the_two_scale_rules_differ_where_torchao_clamps():
    """torchao keeps block scales >= 2**-6 (E4M3's smallest normal); Transformer Engine keeps subnormal and
    zero block scales, so its small blocks keep more of their values."""
    x = CASES["subnormal_scales"]
    ao, te = nvfp4_quantize(x, rule="torchao"), nvfp4_quantize(x)
    assert ao.scales.min() == 2.0**-6 and 0 < te.scales[5].min() < 2.0**-6 and np.all(te.scales[7] == 0)
    err = {k: np.abs(nvfp4_dequantize(c, rule=k) - x)[5:7].sum() for k, c in (("torchao", ao),
                                                                                ("transformer-engine", te))}
    assert err["transformer-engine"] < err["torchao"]


def test_saturated_and_flushed_fractions():
    """Saturation: elements whose scaled magnitude exceeds 6 after their block scale rounded down; flushing:
    non-zero elements that cast to zero (the rows far below the tensor's amax)."""
    x = CASES["random"]
    cast = nvfp4_quantize(x)
    scaled = x * np.repeat(cast.encode, 16, axis=1)
    assert nvfp4_saturated_fraction(x, cast) == np.mean(np.abs(scaled) > 6) > 0
    assert np.all(np.abs(cast.values[np.abs(scaled) > 6]) == 6)
    sub = CASES["subnormal_scales"]
    cast = nvfp4_quantize(sub)
    assert np.all(cast.scales[7] == 0)  # row 7: every block scale is zero, the whole row stands for zero
    dq = nvfp4_dequantize(cast)
    assert nvfp4_flushed_fraction(sub, cast) == np.mean((sub != 0) & (dq == 0)) >= sub.shape[1] / sub.size
    scaled = sub * np.repeat(cast.encode, 16, axis=1)
    assert nvfp4_saturated_fraction(sub, cast) == np.mean((np.abs(scaled) > 6) & (np.repeat(cast.scales, 16, 1) > 0))
    assert nvfp4_saturated_fraction(CASES["zeros"], nvfp4_quantize(CASES["zeros"])) == 0


def test_2d_weight_tiles_are_transposable():
    """With 16 x 16 tiles the cast of W^T is the transpose of the cast of W (forward and dgrad agree)."""
    w = CASES["wide_rows"]
    a, b = nvfp4_quantize(w, tile=(16, 16)), nvfp4_quantize(np.ascontiguousarray(w.T), tile=(16, 16))
    assert np.array_equal(a.values.T, b.values) and np.array_equal(a.scales.T, b.scales)


def test_padding_to_whole_blocks():
    x = np.random.default_rng(3).standard_normal((5, 40)).astype(np.float32)
    cast = nvfp4_quantize(x)
    assert cast.values.shape == (5, 40) and cast.scales.shape == (5, 3)
    tail = nvfp4_quantize(np.pad(x[:, 32:], ((0, 0), (0, 8))), amax=cast.amax)
    assert np.array_equal(cast.values[:, 32:], tail.values[:, :8])


# -- the random Hadamard transform --------------------------------------------------------------------


def test_hadamard_matrix_normalization_and_signs():
    h = hadamard_matrix(16, TE_SIGNS, normalized=False)
    assert np.array_equal(h @ h.T, 16 * np.eye(16))
    i, j = np.meshgrid(range(16), range(16), indexing="ij")
    sylvester = (-1.0) ** np.vectorize(lambda a: bin(a).count("1"))(i & j)
    assert np.array_equal(h, np.array(TE_SIGNS)[:, None] * sylvester)  # S H_16, as Transformer Engine builds it
    r = hadamard_matrix(16, TE_SIGNS)
    assert np.allclose(r @ r.T, np.eye(16), atol=1e-15)


def test_rht_is_the_blockwise_matmul_and_cancels_in_the_product():
    rng = np.random.default_rng(4)
    r = hadamard_matrix(16, TE_SIGNS)
    grid = (np.round(rng.standard_normal((8, 64)) * 16) / 16).astype(np.float32)  # sums exact in float32
    blocks = grid.reshape(-1, 16).astype(np.float64) @ r
    assert np.array_equal(random_hadamard_transform(grid), blocks.reshape(8, 64).astype(np.float32))
    assert np.array_equal(inverse_random_hadamard_transform(random_hadamard_transform(grid)), grid)
    x = rng.standard_normal((8, 64))
    w = rng.standard_normal((12, 64))
    rx, rw = (x.reshape(-1, 16) @ r).reshape(x.shape), (w.reshape(-1, 16) @ r).reshape(w.shape)
    assert np.allclose(rx @ rw.T, x @ w.T, rtol=0, atol=1e-12)  # (xR)(wR)^T = x w^T, checked in float64
    x32 = x.astype(np.float32)
    assert np.allclose(random_hadamard_transform(x32), rx, rtol=0, atol=4 * 2.0**-24 * np.abs(x).max() * 4)
    spike = np.zeros((1, 16), np.float32)
    spike[0, 5] = 64.0
    assert np.all(np.abs(random_hadamard_transform(spike)) == 16.0)  # an outlier spread over its block


def test_rht_signs_are_seeded_and_deterministic():
    assert rht_signs() == TE_SIGNS == (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)
    assert rht_signs(7) == rht_signs(7) != rht_signs(8)
    assert set(rht_signs(7, 64)) == {1, -1} and len(rht_signs(7, 64)) == 64
    x = np.random.default_rng(5).standard_normal((4, 32)).astype(np.float32)
    assert np.array_equal(random_hadamard_transform(x, rht_signs(3)), random_hadamard_transform(x, rht_signs(3)))
    for bad in ({"seed": None, "size": 32}, {"seed": -1}, {"seed": 1, "size": 12}):
        with pytest.raises(ValueError):
            rht_signs(**bad)
    with pytest.raises(ValueError, match="multiple of 16"):
        random_hadamard_transform(np.zeros((2, 24), np.float32))


# -- stochastic rounding -----------------------------------------------------------------------------


def _draws(x: np.ndarray, n: int, tile=(1, 16)) -> np.ndarray:
    return np.stack([nvfp4_quantize(x, tile=tile, sr_key=sr_key(11, 0, t)).values for t in range(n)])


def test_stochastic_rounding_is_unbiased_and_adjacent():
    """Over n = 2000 counters the mean of the E2M1 values is within 5 standard errors of the scaled input
    (|x enc|: each draw is one of its two grid neighbours, so a draw's variance is at most step**2 / 4)
    plus the 2**-16 granularity of the thresholds; the scales are those of round-to-nearest."""
    x = CASES["bf16_values"][:8]
    rn = nvfp4_quantize(x)
    scaled = x * np.repeat(rn.encode, 16, axis=1)
    step = np.where(np.abs(scaled) >= 4, 2.0, np.where(np.abs(scaled) >= 2, 1.0, 0.5))
    n = 2000
    draws = _draws(x, n)
    low = np.sign(scaled) * np.floor(np.abs(scaled) / step) * step
    assert np.all((draws == low) | (draws == low + np.sign(scaled) * step))  # one of the two neighbours
    bound = step * (5 * 0.5 / np.sqrt(n) + 2.0**-16)
    assert np.all(np.abs(draws.mean(0) - np.clip(scaled, -6, 6)) <= bound)
    assert np.array_equal(nvfp4_quantize(x, sr_key=sr_key(11, 0, 0)).scales, rn.scales)
    assert not np.array_equal(draws[0], draws[1])


@pytest.mark.parametrize("variant", ["1x16", "2d", "rht_columnwise"])
def test_averaged_stochastic_rounding_beats_nearest(variant):
    """Transformer Engine's SR test: the mean of 50 dequantized SR draws has a lower RMSE than the
    round-to-nearest cast (rowwise, 2D and the RHT'd transposed operand)."""
    x = np.random.default_rng(6).standard_normal((64, 128)).astype(np.float32) * 2 - 1
    tile, signs = ((16, 16), None) if variant == "2d" else ((1, 16), None)
    if variant == "rht_columnwise":
        x, signs = random_hadamard_transform(np.ascontiguousarray(x.T)), None
    rn = nvfp4_dequantize(nvfp4_quantize(x, tile=tile, signs=signs), tile=tile)
    sr = np.mean([nvfp4_dequantize(nvfp4_quantize(x, tile=tile, sr_key=sr_key(5, 1, t)), tile=tile)
                  for t in range(50)], axis=0)
    rmse = {k: np.sqrt(np.mean((v - x) ** 2)) for k, v in (("sr", sr), ("rn", rn))}
    assert rmse["sr"] < rmse["rn"], rmse


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
