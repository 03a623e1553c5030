"""NVFP4 casts in the core (mp_callbacks.fp8: fp4, nvfp4, hadamard): the NumPy reference against torchao.

The E2M1 rounding equals torchao's ``f32_to_f4_unpacked`` and the packing its ``pack_uint4``; the 1 x 16
two-level (and single-level) cast under ``scale_rule="torchao"`` equals ``nvfp4_quantize`` bit for bit
(packed codes, E4M3 scale bits, the tensor scale) and its dequantization ``NVFP4Tensor.dequantize``, on
random and adversarial operands (tests/core/nvfp4_cases.py).  Where torchao's arithmetic is not finite
(NaN/inf inputs, an all-zero tensor, a tensor scale whose reciprocal overflows) the blocks are flagged.
Then the properties the recipe relies on: the RHT's orthogonality and its cancellation in the matmul,
stochastic rounding unbiased and better than nearest on average.  Transformer Engine's reference is compared
in test_nvfp4_te.py, the Linear's matmuls in test_nvfp4_recipe.py.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from mp_callbacks.fp8 import (
    E2M1_VALUES,
    FP4_CODE_VALUES,
    TE_SIGNS,
    e4m3_bits,
    e4m3_from_bits,
    fp4_codes,
    fp4_round,
    fp4_values,
    hadamard_matrix,
    inverse_random_hadamard_transform,
    nvfp4_dequantize,
    nvfp4_flushed_fraction,
    nvfp4_quantize,
    nvfp4_saturated_fraction,
    pack_fp4,
    random_hadamard_transform,
    rht_signs,
    unpack_fp4,
)
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
