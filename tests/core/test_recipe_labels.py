"""Recipe labels: ``fp8-mixed[<granularity>]`` is ``fp8-mixed`` with ``fp8={"granularity": ...}``."""

import pytest

from mp_callbacks.fp8.granularity import GRANULARITIES
from mp_callbacks.recipes import RECIPE_NAMES, RecipeError, get_recipe, recipe_label, split_recipe_label


@pytest.mark.parametrize("kind", GRANULARITIES)
def test_label_is_the_recipe_with_that_granularity(kind):
    assert get_recipe(f"fp8-mixed[{kind}]") == get_recipe("fp8-mixed", fp8={"granularity": kind})
    assert split_recipe_label(f" FP8-Mixed[{kind.upper()}] ") == ("fp8-mixed", kind)
    assert recipe_label(f"FP8-Mixed[{kind.upper()}]") == f"fp8-mixed[{kind}]"


@pytest.mark.parametrize("name", [*RECIPE_NAMES, "mixed_float16"])
def test_plain_names_are_unchanged(name):
    assert split_recipe_label(name) == (get_recipe(name).name, None)
    assert get_recipe(recipe_label(name)) == get_recipe(name)


def test_label_keeps_other_fp8_settings():
    reference = get_recipe("fp8-mixed", fp8={"granularity": "rowwise", "preset": "torchao"})
    assert get_recipe("fp8-mixed[rowwise]", fp8={"preset": "torchao"}) == reference
    assert get_recipe("fp8-mixed[rowwise]", fp8={"granularity": "rowwise", "preset": "torchao"}) == reference


@pytest.mark.parametrize("label, words", [
    ("fp8-mixed[colwise]", ["'colwise'", *GRANULARITIES]),
    ("bf16-mixed[rowwise]", ["only fp8-mixed", *GRANULARITIES]),
    ("fp8-mixed[rowwise", ["unknown recipe", "fp8-mixed"]),
])
def test_bad_labels_say_what_is_valid(label, words):
    with pytest.raises(RecipeError) as info:
        get_recipe(label)
    assert all(w in str(info.value) for w in words), str(info.value)


def test_granularity_given_twice_differently_is_refused():
    with pytest.raises(RecipeError, match="once"):
        get_recipe("fp8-mixed[rowwise]", fp8={"granularity": "mxfp8"})
