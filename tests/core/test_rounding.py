"""Update rounding without masters (mp_callbacks.weights): the rules against exact rational arithmetic and
float64 references, the counter-based random source against the integer recipe written out by hand, and
the bf16-kahan / bf16-sr recipes and memory figures."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest

from mp_callbacks import get_recipe
from mp_callbacks.diagnostics import half_ulp
from mp_callbacks.memory import bytes_per_param, estimate_memory
from mp_callbacks.recipes import RECIPE_NAMES, RecipeError, canonical_recipe_name
from mp_callbacks.settings import StateDictError
from mp_callbacks.weights import NUMPY_ROUNDING_OPS as OPS
from mp_callbacks.weights import (
    PY_INT_OPS,
    MasterPlan,
    RoundingStream,
    bf16_bits,
    bf16_to_f32,
    initial_compensation,
    kahan_add,
    kahan_apply,
    make_rounding_state,
    mix32,
    read_rounding_state,
    round_with_thresholds,
    sr_key,
    sr_thresholds,
    stochastic_round,
)

M = 2**32


# ---------------------------------------------------------------- by hand
def lowbias32(x: int) -> int:
    """Wellons' lowbias32, written out on Python integers (the documented recipe)."""
    x %= M
    x ^= x >> 16
    x = (x * 0x7FEB352D) % M
    x ^= x >> 15
    x = (x * 0x846CA68B) % M
    x ^= x >> 16
    return x


def key_by_hand(seed: int, tensor: int, step: int) -> int:
    return lowbias32(lowbias32(lowbias32(seed) ^ tensor) ^ step)


def bf16_round_exact(q: Fraction) -> Fraction:
    """Round a rational to the nearest bf16 number (ties to even), normal range, by exact arithmetic."""
    if q == 0:
        return Fraction(0)
    sign = -1 if q < 0 else 1
    a = abs(q)
    e = a.numerator.bit_length() - a.denominator.bit_length()
    if Fraction(2) ** e > a:
        e -= 1
    assert e >= -126, "normal range only"
    ulp = Fraction(2) ** (e - 7)
    n, r = divmod(a, ulp)
    if r > ulp / 2 or (r == ulp / 2 and n % 2 == 1):
        n += 1
    return sign * n * ulp


def bf16_of(bits: np.ndarray) -> list[Fraction]:
    return [Fraction(float(v)) for v in bf16_to_f32(bits).ravel()]


def rng(seed=0):
    return np.random.default_rng(seed)


# ---------------------------------------------------------- the random source
def test_mix32_and_keys_follow_the_integer_recipe():
    xs = [0, 1, 2, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF, *rng().integers(0, M, 200).tolist()]
    assert [mix32(x, PY_INT_OPS) for x in xs] == [lowbias32(x) for x in xs]
    got = mix32(OPS.u32(np.array(xs, dtype=np.uint64)), OPS)
    assert got.dtype == np.uint32 and got.tolist() == [lowbias32(x) for x in xs]
    for seed, tensor, step in [(0, 0, 0), (1, 0, 0), (0, 1, 0), (0, 0, 1), (2**40 + 7, 3, 12345), (M - 1, 9, M - 1)]:
        assert sr_key(seed, tensor, step) == key_by_hand(seed % M, tensor, step % M)
        # the same rule on u32 arrays (what a graph-mode backend evaluates from its counters)
        assert int(sr_key(seed, tensor, step, OPS)) == sr_key(seed, tensor, step)
    key = sr_key(5, 2, 17)
    index = np.arange(1000, dtype=np.uint32)
    assert sr_thresholds(key, index, OPS).tolist() == [lowbias32(key ^ i) >> 16 for i in range(1000)]


def test_mix32_is_a_bijection_on_a_sample():
    x = np.arange(2**20, dtype=np.uint32) * np.uint32(4099)  # distinct inputs
    assert np.unique(mix32(x, OPS)).size == x.size


def test_thresholds_are_uniform_and_streams_differ():
    index = np.arange(2**16, dtype=np.uint32)
    draws = {(seed, t, s): sr_thresholds(sr_key(seed, t, s), index, OPS).astype(np.int64)
             for seed in (0, 1) for t in (0, 1) for s in (0, 1, 2)}
    for r in draws.values():
        assert r.min() >= 0 and r.max() < 2**16
        counts = np.bincount(r >> 8, minlength=256)  # 256 buckets of 256 thresholds, 256 expected in each
        chi2 = float(((counts - 256.0) ** 2 / 256.0).sum())
        assert chi2 < 255 + 6 * np.sqrt(2 * 255)  # mean 255, sd ~22.6
        assert abs(r.mean() - 32767.5) < 6 * 18918 / 256  # sd of a uniform / sqrt(n)
        bits = (r[:, None] >> np.arange(16)) & 1
        assert np.all(np.abs(bits.mean(0) - 0.5) < 6 * 0.5 / 256)
    rows = list(draws.values())
    for i in range(len(rows)):
        for j in range(i + 1, len(rows)):
            assert abs(np.corrcoef(rows[i], rows[j])[0, 1]) < 6 / 256
            assert np.mean(rows[i] == rows[j]) < 0.001
    # one element over many steps: its thresholds are uniform too
    over_steps = np.array([int(sr_thresholds(sr_key(3, 4, s), np.array([7], np.uint32), OPS)[0])
                           for s in range(4096)])
    assert abs(over_steps.mean() - 32767.5) < 6 * 18918 / 64


# ------------------------------------------------------- stochastic rounding
def _neighbours(x: np.float32) -> tuple[Fraction, Fraction]:
    """The bf16 numbers around float32 ``x``: truncation toward zero and one bf16 step away from zero."""
    b = int(np.float32(x).view(np.uint32))
    down = b & 0xFFFF0000
    up = down + 0x10000
    as_f = lambda bits: Fraction(float(np.uint32(bits).view(np.float32)))  # noqa: E731
    return as_f(down), as_f(up)


def _floats(n: int, seed: int = 0) -> np.ndarray:
    r = rng(seed)
    mags = np.exp2(r.uniform(-130, 120, n)) * r.uniform(1, 2, n)
    x = (mags * r.choice([-1, 1], n)).astype(np.float32)
    extra = np.array([1.0, 1.0 + 2**-8, 1.0 + 2**-23, -3.0000002, 2.0**-128, 2.0**-140, 255.99998], np.float32)
    return np.concatenate([x, extra])


def test_stochastic_rounding_expectation_is_exact_over_all_thresholds():
    """Over the 2**16 thresholds, E[sr(x)] == x in exact rational arithmetic, for normal and subnormal x."""
    all_r = np.arange(2**16, dtype=np.uint32)
    for x in _floats(60):
        out = round_with_thresholds(np.full(2**16, x, np.float32), all_r, OPS)
        values = bf16_to_f32(out)
        down, up = _neighbours(x)
        n_up = int(np.count_nonzero(values != np.float32(float(down))))
        assert set(map(Fraction, map(float, np.unique(values)))) <= {down, up}
        assert (down * (2**16 - n_up) + up * n_up) / 2**16 == Fraction(float(x)), x
        # P(away from zero) is the dropped fraction of the float32 bits
        assert n_up == int(np.float32(x).view(np.uint32)) & 0xFFFF


def test_stochastic_rounding_keeps_exact_values_and_specials():
    exact = bf16_to_f32(bf16_bits(_floats(100)))  # bf16 values: nothing to round
    key = sr_key(0, 0, 0)
    assert np.array_equal(bf16_to_f32(stochastic_round(exact, key, OPS)), exact)
    special = np.array([np.inf, -np.inf, np.nan, 0.0, -0.0], np.float32)
    got = bf16_to_f32(stochastic_round(special, key, OPS))
    assert np.isposinf(got[0]) and np.isneginf(got[1]) and np.isnan(got[2])
    assert np.array_equal(got[3:].view(np.uint32), special[3:].view(np.uint32))


def test_stochastic_rounding_is_unbiased_where_nearest_stalls():
    """Weights at 1.0, 1000 updates of 3e-4 (under half a bf16 ulp, 2**-8): the float64 sum is 1.3.
    Round-to-nearest never moves; SR's mean over 4096 independent elements (streams) lands on it."""
    n, steps, u = 4096, 1000, np.float32(3e-4)
    w_rn = np.full(n, bf16_bits(np.float32(1.0)), np.uint16)
    w_sr = w_rn.copy()
    for step in range(steps):
        w_rn = bf16_bits(bf16_to_f32(w_rn) + u)
        w_sr = stochastic_round(bf16_to_f32(w_sr) + u, sr_key(11, 0, step), OPS)
    exact = 1.0 + steps * float(u)
    assert np.all(bf16_to_f32(w_rn) == 1.0)
    final = bf16_to_f32(w_sr).astype(np.float64)
    # per step the rounding error has variance <= ulp**2 / 4 (ulp <= 2**-7 here): sd of the mean below
    sd_mean = np.sqrt(steps) * 2**-7 / 2 / np.sqrt(n)
    assert abs(final.mean() - exact) < 5 * sd_mean, (final.mean(), exact)
    assert final.std() > 0  # the elements really drew different numbers


def test_index_argument_draws_another_layouts_numbers():
    """An adapter whose layout is the transpose passes the other layout's indices: same draw per element."""
    x = rng(1).standard_normal((6, 10)).astype(np.float32)
    key = sr_key(9, 3, 4)
    rows_first = stochastic_round(x, key, OPS)  # (out, in) layout, row-major indices
    transposed_index = np.arange(60, dtype=np.uint32).reshape(6, 10).T
    cols_first = stochastic_round(np.ascontiguousarray(x.T), key, OPS, index=transposed_index)
    assert np.array_equal(cols_first, rows_first.T)


# --------------------------------------------------------------------- Kahan
def _bf16_values(n: int, seed: int, scale: float = 1.0) -> np.ndarray:
    r = rng(seed)
    return bf16_bits((r.standard_normal(n) * scale * np.exp2(r.integers(-12, 12, n))).astype(np.float32))


def test_kahan_operations_equal_exact_rational_arithmetic_rounded_once():
    """Each operation of the reference is the exact result rounded once to bf16 (ties to even)."""
    w = _bf16_values(3000, 1)
    c = _bf16_values(3000, 2, 2.0**-9)
    u = (rng(3).standard_normal(3000) * np.exp2(rng(4).integers(-20, 0, 3000))).astype(np.float32)
    new, c2 = kahan_add(w, c, u, OPS)
    for wi, ci, ui, ni, ki in zip(bf16_of(w), bf16_of(c), map(Fraction, map(float, u)), bf16_of(new), bf16_of(c2)):
        y = bf16_round_exact(bf16_round_exact(ui) + ci)
        n = bf16_round_exact(wi + y)
        assert ni == n
        assert ki == bf16_round_exact(y - bf16_round_exact(n - wi))


def test_kahan_apply_is_kahan_add_of_the_optimizers_update():
    w, c = _bf16_values(500, 5), _bf16_values(500, 6, 2.0**-9)
    t_new = (bf16_to_f32(w) + bf16_to_f32(c) + rng(7).standard_normal(500).astype(np.float32) * 1e-3)
    u = t_new - (bf16_to_f32(w) + bf16_to_f32(c))
    for a, b in zip(kahan_apply(w, c, t_new, OPS), kahan_add(w, c, u, OPS)):
        assert np.array_equal(a, b)


def test_kahan_tracks_the_exact_sum_where_nearest_stalls():
    """Weights near 1.0, 1000 updates below half an ulp: w + c follows the exact rational sum (the error is
    the rounding of each update to bf16, relative 2**-9, mostly cancelling), nearest rounding stalls."""
    n, steps = 64, 1000
    r = rng(8)
    w0 = bf16_bits(np.float32(1.0) - r.uniform(0, 0.01, n).astype(np.float32))
    updates = (r.uniform(-0.2, 1.0, (steps, n)) * 2**-10).astype(np.float32)  # |u| < 2**-10 < half ulp
    w, c, w_rn = w0.copy(), np.zeros(n, np.uint16), w0.copy()
    for u in updates:
        w, c = kahan_add(w, c, u, OPS)
        w_rn = bf16_bits(bf16_to_f32(w_rn) + u)
    exact = [Fraction(float(a)) + sum(Fraction(float(b)) for b in updates[:, i]) for i, a in enumerate(bf16_to_f32(w0))]
    moved = [abs(e - Fraction(float(a))) for e, a in zip(exact, bf16_to_f32(w0))]
    kahan = [Fraction(float(a)) + Fraction(float(b)) for a, b in zip(bf16_to_f32(w), bf16_to_f32(c))]
    err = [abs(k - e) for k, e in zip(kahan, exact)]
    bound = [2.0**-9 * float(sum(abs(Fraction(float(b))) for b in updates[:, i])) + 2.0**-16 for i in range(n)]
    assert all(float(e) <= b for e, b in zip(err, bound))
    assert float(max(e / m for e, m in zip(err, moved))) < 0.01  # within 1% of how far it moved
    assert np.array_equal(w_rn, w0)  # nearest rounding: nothing moved
    # the compensation is what w could not hold: at most half an ulp of w
    assert np.all(np.abs(bf16_to_f32(c)) <= half_ulp(bf16_to_f32(w), "bfloat16"))


def test_initial_compensation_keeps_the_fp32_value():
    x = (rng(9).standard_normal(2000) * np.exp2(rng(10).integers(-20, 20, 2000))).astype(np.float32)
    w = bf16_bits(x)
    c = initial_compensation(x, w, OPS)
    assert np.array_equal(c, bf16_bits(x - bf16_to_f32(w)))
    err = np.abs(bf16_to_f32(w).astype(np.float64) + bf16_to_f32(c) - x)
    assert np.all(err <= np.abs(x).astype(np.float64) * 2.0**-16)  # 16 significant bits kept


def test_float16_storage_uses_numpys_half():
    w, c = np.array([1.0, 2.0], np.float16), np.zeros(2, np.float16)
    new, c2 = kahan_add(w, c, np.array([1e-4, 3e-4], np.float32), OPS)
    assert new.dtype == c2.dtype == np.float16 and np.all(new + c2.astype(np.float32) != w)


# ------------------------------------------------------------ stream, records
def test_stream_and_checkpoint_record():
    stream = RoundingStream(seed=7)
    assert stream.key(3) == sr_key(7, 3, 0) and stream.advance().key(3) == sr_key(7, 3, 1)
    record = make_rounding_state("stochastic", stream.advance(), "bf16")
    assert record == {"schema_version": 1, "mode": "stochastic", "storage": "bfloat16", "seed": 7, "counter": 1}
    assert read_rounding_state("stochastic", record) == RoundingStream(7, 1)
    with pytest.raises(StateDictError, match="rounds updates with 'stochastic'; this run with 'kahan'"):
        read_rounding_state("kahan", record)
    with pytest.raises(StateDictError, match="schema v2"):
        read_rounding_state("stochastic", {**record, "schema_version": 2})
    with pytest.raises(StateDictError, match="no update-rounding state"):
        read_rounding_state("kahan", None)
    with pytest.raises(ValueError, match="seed=-1"):
        RoundingStream(-1)


# ------------------------------------------------------------ recipes, memory
def test_recipes_and_names():
    assert RECIPE_NAMES[0] == "32-true" and RECIPE_NAMES[5:7] == ("bf16-kahan", "bf16-sr")
    kahan, sr = get_recipe("bf16-kahan"), get_recipe("bf16-sr")
    for r, mode in ((kahan, "kahan"), (sr, "stochastic")):
        assert (r.policy.params, r.policy.compute, r.master.master_weights, r.master.update_rounding,
                r.master.state_dtype, r.scaler.enabled, r.autocast) == (
            "bfloat16", "bfloat16", False, mode, "float32", False, False)
        assert type(r).from_dict(r.to_dict()) == r
    assert get_recipe("bf16-sr", state_dtype="bf16").master.state_dtype == "bfloat16"
    assert get_recipe("bf16-sr", scaler="torch").scaler.enabled  # scaling stays opt-in
    assert canonical_recipe_name("bf16-kahan") == "bf16-kahan"
    with pytest.raises(RecipeError, match="unknown recipe 'kahan' .did you mean 'bf16-kahan'"):
        get_recipe("kahan")
    with pytest.raises(RecipeError, match="recipe 'bf16-master': state_dtype='bfloat16' is only offered"):
        get_recipe("bf16-master", state_dtype="bfloat16")
    with pytest.raises(ValueError, match="update_rounding='nope' is invalid"):
        MasterPlan(param_dtype="bfloat16", update_rounding="nope")
    with pytest.raises(ValueError, match="needs low-precision weights without master copies"):
        MasterPlan(param_dtype="bfloat16", master_weights=True, update_rounding="kahan")
    with pytest.raises(ValueError, match="param_dtype must be bfloat16"):
        MasterPlan(param_dtype="float16", update_rounding="stochastic")
    # a plan saved before update rounding existed still loads
    assert MasterPlan.from_dict({"param_dtype": "bfloat16", "master_weights": True, "state_dtype": "float32"})


# bytes per element, written out: bf16 = 16 bits, FP32 = 32 bits; slots: AdamW m, v; SGD-momentum one buffer
BF16, FP32 = 16 // 8, 32 // 8
SLOTS = {"adamw": 2, "sgd-momentum": 1, "sgd": 0}


@pytest.mark.parametrize("optimizer", list(SLOTS))
@pytest.mark.parametrize("states", ["float32", "bfloat16"])
def test_memory_figures_by_hand(optimizer, states):
    state_size = FP32 if states == "float32" else BF16
    kahan = BF16 + BF16 + BF16 + SLOTS[optimizer] * state_size  # weight, grad, compensation, states
    sr = BF16 + BF16 + SLOTS[optimizer] * state_size
    assert bytes_per_param(get_recipe("bf16-kahan", state_dtype=states).master, optimizer) == kahan
    assert bytes_per_param(get_recipe("bf16-sr", state_dtype=states).master, optimizer) == sr
    # at the optimizer step: no masters, nothing released: the same figures
    assert bytes_per_param(get_recipe("bf16-kahan", state_dtype=states).master, optimizer,
                           fp32_master_grads=True, weights_released=True) == kahan


def test_the_issues_figures_and_fp32_kept_parameters():
    """AdamW: bf16-kahan 2 + 2 + 2 + 8 = 14, bf16-sr 12; each minus 4 with bf16 states."""
    assert [bytes_per_param(get_recipe(r, state_dtype=s).master, "adamw")
            for r in ("bf16-kahan", "bf16-sr") for s in ("float32", "bfloat16")] == [14, 10, 12, 8]
    est = estimate_memory(get_recipe("bf16-kahan", state_dtype="bfloat16").master, "adamw",
                          [(100, "bfloat16"), (30, "float32")])
    # FP32-kept parameters: FP32 weight, grad and states, no compensation
    assert (est.weights, est.grads, est.masters, est.compensation, est.optimizer_state) == (
        100 * 2 + 30 * 4, 100 * 2 + 30 * 4, 0, 100 * 2, 100 * 2 * 2 + 30 * 2 * 4)
    assert est.total == sum((est.weights, est.grads, est.compensation, est.optimizer_state))
    assert est.to_dict()["compensation"] == 200
