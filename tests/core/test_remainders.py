"""The bf16 + 16-bit remainder split (:mod:`mp_callbacks.weights.remainders`): exact for every float32 pattern, and the
forward weight is nearest-even rounding except on the ties it rounds away from zero."""

import numpy as np
import pytest

from mp_callbacks.memory import bytes_per_param
from mp_callbacks.recipes import RecipeError, get_recipe
from mp_callbacks.weights import MasterPlan, bf16_bits, join_master, split_master, ties_differ

EDGES = [0, 0x8000, 0x18000, 0x80008000, 0x7F7E8000, 0x7F7F8000, 0x7F800000, 0xFF800000, 0x7FC00000, 0x7FFFFFFF,
         0xFFFFFFFF, 0x80000000, 1, 0x007FFFFF, 0x3F800000, 0x3F808000, 0x3F818000]


def patterns() -> np.ndarray:
    rng = np.random.default_rng(0)
    low16 = np.arange(2**16, dtype=np.uint32)  # every lower half under a few upper halves
    upper = np.array([0x0000, 0x3F80, 0x3F81, 0xBF80, 0x7F7F, 0x7F80, 0xFFC0], dtype=np.uint32)
    every = ((upper[:, None] << 16) | low16[None, :]).ravel()
    return np.concatenate([every, rng.integers(0, 2**32, 500_000, dtype=np.uint64).astype(np.uint32),
                           np.array(EDGES, dtype=np.uint32)])


def test_join_of_split_is_exact_for_every_pattern():
    b = patterns()
    w, r = split_master(b.view(np.float32))
    assert w.dtype == np.uint16 and r.dtype == np.int16
    np.testing.assert_array_equal(join_master(w, r).view(np.uint32), b)


def test_forward_weight_is_nearest_even_except_ties_rounding_down_to_even():
    b = patterns()
    x = b.view(np.float32)
    w, _ = split_master(x)
    rne = bf16_bits(x)
    finite = ~np.isnan(x)
    differs = (w != rne) & finite
    np.testing.assert_array_equal(differs, ties_differ(x))
    # where they differ, the forward weight is the next bf16 away from zero (its magnitude one ulp up)
    np.testing.assert_array_equal(w[differs].astype(np.int64), rne[differs].astype(np.int64) + 1)
    forward = (np.asarray(w[differs], np.uint32) << np.uint32(16)).view(np.float32)
    assert differs.any() and np.all(np.abs(forward) > np.abs(x[differs]))


def test_plan_recipe_and_estimate():
    recipe = get_recipe("bf16-master", master_remainders=True)
    assert recipe.master.master_remainders and MasterPlan.from_dict(recipe.master.to_dict()) == recipe.master
    assert get_recipe("fp8-mixed", master_remainders=True).master.master_remainders
    assert bytes_per_param(recipe.master, "adamw") == 14.0
    assert bytes_per_param(recipe.master, "adamw", fp32_master_grads=True, weights_released=True) == \
        bytes_per_param(get_recipe("bf16-master").master, "adamw", fp32_master_grads=True, weights_released=True)
    for name in ("16-master", "bf16-kahan", "bf16-mixed"):
        with pytest.raises(RecipeError, match="master_remainders"):
            get_recipe(name, master_remainders=True)
