"""NVFP4 in the core against Transformer Engine's pure-PyTorch reference (``NVFP4QuantizerRef``).

Two forms.  The golden vectors (tests/core/data/nvfp4_te_golden.npz, made by tests/core/make_nvfp4_golden.py
from the reference at the commit recorded in the file) run everywhere: the 1 x 16 and 16 x 16 casts equal
the reference bit for bit (packed codes, E4M3 scale bits, amax; rowwise and columnwise) on every operand of
tests/core/nvfp4_cases.py; with the RHT, the cast of the reference's transformed operand equals it bit for
bit, our transform is within float32 summation error of the reference's matmul (equal where the sums are
exact), and so the whole path is bit for bit on those operands.  With ``TE_REFERENCE_DIR`` set (the
reference files, see tests/core/te_reference.py) the same comparisons run against the reference itself,
the golden file is checked to be what the reference makes, and the Linear's three matmuls are compared with
the reference's GEMM.

One convention differs and is compared as such: the reference's ``cast_to_fp4x2`` gives a scaled value of
exactly ``-0.0`` code 0, we (like torchao and the hardware's conversion) code 8; both are zero.  The
reference has no stochastic rounding: ours is checked against its round-to-nearest scales and grid.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from mp_callbacks.fp8 import (
    TE_SIGNS,
    NVFP4Recipe,
    e4m3_bits,
    fp4_codes,
    nvfp4_linear_reference,
    nvfp4_operand,
    nvfp4_quantize,
    pack_fp4,
    random_hadamard_transform,
)
from mp_callbacks.weights import sr_key

from .make_nvfp4_golden import GOLDEN, VARIANTS, golden_arrays
from .nvfp4_cases import cases, nonfinite_cases
from .te_reference import TE_COMMIT, load_reference, reference_dir, te_cast

TE_DIR = reference_dir()
needs_te = pytest.mark.skipif(TE_DIR is None or importlib.util.find_spec("torch") is None,
                              reason="TE_REFERENCE_DIR is not set (Transformer Engine's reference) or no torch")
"""The golden-vector tests need neither Transformer Engine nor torch; the tests against the reference need both
the reference files and torch."""
GOLD = dict(np.load(GOLDEN))
NAMES = [str(n) for n in GOLD["cases"]]
EXACT_RHT = {"zeros", "ties", "exact_ties", "bf16_values"}
"""Operands whose transform sums are exact in float32 (any order gives the same bits)."""


def te_codes(values: np.ndarray, scaled: np.ndarray) -> np.ndarray:
    """Our E2M1 values as the reference packs them: a scaled value of exactly -0.0 is code 0 there."""
    codes = fp4_codes(values)
    negative_zero = (scaled == 0) & np.signbit(scaled)
    return pack_fp4(np.where(negative_zero, 0, codes))


def ours(x: np.ndarray, tile: tuple[int, int], transformed_t: np.ndarray | None = None,
         signs: tuple[int, ...] | None = None) -> dict[str, np.ndarray]:
    """Our cast in the reference's layout: rowwise of ``x``, columnwise of ``x^T`` (or of ``transformed_t``,
    an already transformed ``x^T``; ``signs``: transform ``x^T`` ourselves)."""
    out = {}
    xt = np.ascontiguousarray(x.T) if transformed_t is None else transformed_t
    for suffix, a, sg in (("", x, None), ("_t", xt, signs)):
        operand = random_hadamard_transform(a, sg) if sg is not None else a
        cast = nvfp4_quantize(operand, tile)
        with np.errstate(over="ignore", invalid="ignore"):
            scaled = operand * np.repeat(np.repeat(cast.encode, tile[0], 0), tile[1], 1)
        out["codes" + suffix] = te_codes(cast.values, scaled)
        out["scales" + suffix] = np.repeat(e4m3_bits(cast.scales), tile[0], 0)  # one row per data row
        out["amax" + suffix] = np.float32(cast.amax).reshape(())
        out["finite" + suffix] = np.asarray(cast.finite)
    return out


def assert_same(got: dict, want: dict, fields: list[str]) -> None:
    for field in fields:
        a, b = np.asarray(got[field]), np.asarray(want[field])
        assert a.shape == b.shape and np.array_equal(a, b, equal_nan=a.dtype.kind == "f"), field


def golden(name: str, variant: str) -> dict[str, np.ndarray]:
    prefix = f"{name}/{variant}/"
    return {k[len(prefix):]: v for k, v in GOLD.items() if k.startswith(prefix)}


def test_golden_file_records_its_source():
    assert str(GOLD["te_commit"]) == TE_COMMIT
    assert NAMES == sorted(cases())
    for name, x in cases().items():
        assert np.array_equal(GOLD[f"{name}/x"], x)


@pytest.mark.parametrize("variant", ["1x16", "2d"])
@pytest.mark.parametrize("name", NAMES)
def test_casts_equal_the_reference_golden(name, variant):
    tile, _ = VARIANTS[variant]
    fields = ["codes", "scales", "amax", "codes_t", "scales_t", "amax_t"]
    assert_same(ours(GOLD[f"{name}/x"], tile), golden(name, variant), fields)


@pytest.mark.parametrize("name", NAMES)
def test_rht_casts_equal_the_reference_golden(name):
    x, want = GOLD[f"{name}/x"], golden(name, "rht")
    fields = ["codes_t", "scales_t", "amax_t"]
    assert_same(ours(x, (1, 16), transformed_t=want["rht_t"]), want, fields)  # the cast: bit for bit
    mine = random_hadamard_transform(np.ascontiguousarray(x.T), TE_SIGNS)
    # two float32 sums of 16 terms +-x_i / 4: each within 15 * 2**-24 * sum |x_i| / 4 of the exact value, plus
    # 16 float32-subnormal spacings (2**-149) where the terms underflow
    scale = np.repeat(np.abs(x.T).astype(np.float64).reshape(-1, 16).sum(1), 16).reshape(x.T.shape) / 4
    assert np.all(np.abs(mine.astype(np.float64) - want["rht_t"]) <= 2 * (15 * 2.0**-24 * scale + 16 * 2.0**-149))
    if name in EXACT_RHT:
        assert np.array_equal(mine, want["rht_t"])
        assert_same(ours(x, (1, 16), signs=TE_SIGNS), want, fields)  # the whole path: bit for bit


def test_negative_zero_is_the_one_convention_that_differs():
    """A -0.0 input scales to -0.0: the reference codes it 0, we code it 8 (the sign bit kept, as torchao and
    the hardware's conversion); every other code is equal."""
    x = GOLD["zero_blocks/x"]
    cast = nvfp4_quantize(x)
    scaled = x * np.repeat(cast.encode, 16, 1)
    negative_zero = (scaled == 0) & np.signbit(scaled)
    assert negative_zero.any()
    ref = golden("zero_blocks", "1x16")["codes"]
    raw = pack_fp4(fp4_codes(cast.values))
    unpack = lambda p: np.stack([p & 0xF, p >> 4], -1).reshape(p.shape[0], -1)  # noqa: E731
    assert np.all(unpack(raw)[negative_zero] == 8) and np.all(unpack(ref)[negative_zero] == 0)
    assert np.array_equal(unpack(raw)[~negative_zero], unpack(ref)[~negative_zero])


@pytest.mark.parametrize("name", ["random", "wide_rows", "near_ties"])
def test_stochastic_rounding_on_the_reference_grid(name):
    """The reference has no SR: ours keeps its round-to-nearest scales, and each value is one of the two E2M1
    values around the exact scaled value ``x / (s_block * amax / 2688)`` (Transformer Engine's SR test's
    ``check_adjacent``)."""
    x, want = GOLD[f"{name}/x"], golden(name, "1x16")
    for t in range(4):
        cast = nvfp4_quantize(x, sr_key=sr_key(1, 2, t))
        assert np.array_equal(e4m3_bits(cast.scales), want["scales"])
        block = np.repeat(cast.scales, 16, 1).astype(np.float64) * (np.float64(want["amax"]) / 2688)
        with np.errstate(divide="ignore", invalid="ignore"):
            exact = np.clip(x / block, -6, 6)
        exact = np.where(block == 0, cast.values, exact)  # a zero scale: nothing to compare
        mag = np.abs(exact)
        step = np.where(mag >= 4, 2.0, np.where(mag >= 2, 1.0, 0.5))
        assert np.all(np.abs(cast.values - exact) <= step * 1.0001)


# -- against the reference itself -----------------------------------------------------------------------


@needs_te
def test_golden_is_what_the_reference_makes():
    fresh = golden_arrays(TE_DIR)
    assert sorted(fresh) == sorted(GOLD)
    for key, value in fresh.items():
        assert np.array_equal(value, GOLD[key], equal_nan=value.dtype.kind == "f"), key


@needs_te
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("variant", ["1x16", "2d"])
def test_casts_equal_the_reference(variant, dtype):
    import torch

    ref = load_reference(TE_DIR)
    tile, _ = VARIANTS[variant]
    for x in cases().values():
        if dtype == "bfloat16":  # the reference fed bf16: our float32 operand is its exact value
            x = torch.from_numpy(x).to(torch.bfloat16).float().numpy()
        fields = ["codes", "scales", "amax", "codes_t", "scales_t", "amax_t"]
        assert_same(ours(x, tile), te_cast(ref, x, tile, dtype=dtype), fields)


@needs_te
@pytest.mark.parametrize("name", ["nan", "inf", "minus_inf"])
def test_nonfinite_inputs_in_the_reference(name):
    """The reference on NaN: amax NaN, every scale NaN and every code 0 (NaN matches no interval).  On inf:
    amax inf, the global encode scale 2688 / inf = 0 replaced by 1, so the finite blocks get block scales of
    their own and the inf block 448; its decode scale (amax / 2688) is inf.  Ours flags every block of both."""
    ref = load_reference(TE_DIR)
    x = nonfinite_cases()[name]
    te = te_cast(ref, x)
    if name == "nan":
        assert np.isnan(te["amax"]) and np.all((te["scales"] & 0x7F) == 0x7F) and np.all(te["codes"] == 0)
    else:
        assert np.isinf(te["amax"]) and te["scales"][2, 1] == e4m3_bits(np.float32(448.0))
    assert not ours(x, (1, 16))["finite"].any()


@needs_te
def test_linear_matmuls_equal_the_reference_gemm():
    """One Linear's y, dx, dW (round to nearest: the reference has no SR) against the reference's quantizers
    (x, dy: 1 x 16 with RHT on the columnwise copies; W: 16 x 16) and its GEMM ``qgemm`` (per-block products
    in float32, scaled by amax_a amax_b / 2688**2): equal within float32 accumulation error."""
    import torch

    ref = load_reference(TE_DIR)
    rng = np.random.default_rng(12)
    grid = lambda *s: (np.round(rng.standard_normal(s) * 16) / 16).astype(np.float32)  # noqa: E731
    x, w, dy = grid(64, 64), grid(32, 64) / 8, grid(64, 32)  # exact transform sums
    quant = lambda tile, rht: ref.NVFP4QuantizerRef(  # noqa: E731
        dtype=ref.reference_utils.Fp4Formats.E2M1, quant_tile_shape=tile, with_rht=rht)
    qx, qw, qg = (quant(t, r).quantize(torch.from_numpy(a)) for a, t, r in
                  ((x, (1, 16), True), (w, (16, 16), False), (dy, (1, 16), True)))
    gemm = ref.gemm.GEMMType
    q = quant((1, 16), False)
    te = {"y": q.qgemm(qx.data, qw.data, None, torch.float32, qx.scale, qw.scale, qresult_x=qx, qresult_w=qw,
                       gemm_type=gemm.FPROP),
          "dx": q.qgemm(qg.data, qw.data_t, None, torch.float32, qg.scale, qw.scale_t, qresult_x=qg,
                        qresult_w=qw, gemm_type=gemm.DGRAD),
          "dw": q.qgemm(qg.data_t, qx.data_t, None, torch.float32, qg.scale_t, qx.scale_t, qresult_x=qg,
                        qresult_w=qx, gemm_type=gemm.WGRAD)}
    recipe = NVFP4Recipe(stochastic_rounding=False)
    out = nvfp4_linear_reference(x, w, dy, recipe)
    roles = {"y": ((x, "forward_input"), (w, "forward_weight")),
             "dx": ((dy, "dgrad_grad_output"), (w.T, "dgrad_weight")),
             "dw": ((dy.T, "wgrad_grad_output"), (x.T, "wgrad_input"))}
    for key, ((a, role_a), (b, role_b)) in roles.items():
        aq = nvfp4_operand(np.ascontiguousarray(a), recipe, role_a)[0].astype(np.float64)
        bq = nvfp4_operand(np.ascontiguousarray(b), recipe, role_b)[0].astype(np.float64)
        tol = 2 * a.shape[1] * 2.0**-24 * (np.abs(aq) @ np.abs(bq).T)  # two float32 accumulations
        assert np.array_equal(out[key], (aq @ bq.T).astype(np.float32)), key
        assert np.all(np.abs(out[key] - te[key].numpy()) <= tol), key
