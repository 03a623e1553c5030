"""Recipe labels: ``fp8-mixed[<granularity>]`` is ``fp8-mixed`` with ``fp8={"granularity": ...}``;
``state_dtype=<dtype>`` and ``master_remainders`` in the bracket are get_recipe's keywords."""

import pytest

from mp_callbacks.fp8 import GRANULARITIES
from mp_callbacks.recipes import (
    RECIPE_NAMES,
    RecipeError,
    get_recipe,
    parse_recipe_label,
    recipe_label,
    split_recipe_label,
)
from mp_callbacks.weights import STATE_DTYPES


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


# ----------------------------------------------------------- state_dtype= and master_remainders in a label
@pytest.mark.parametrize("label, kwargs", [
    ("bf16-sr[state_dtype=bfloat16]", {"state_dtype": "bfloat16"}),
    ("bf16-kahan[state_dtype=bf16]", {"state_dtype": "bfloat16"}),
    ("bf16-kahan[state_dtype=8bit]", {"state_dtype": "8bit"}),
    ("bf16-master[master_remainders]", {"master_remainders": True}),
    ("bf16-master[state_dtype=8bit, master_remainders]", {"state_dtype": "8bit", "master_remainders": True}),
    ("fp8-mixed[rowwise,state_dtype=8bit]", {"state_dtype": "8bit", "fp8": {"granularity": "rowwise"}}),
])
def test_state_options_in_a_label_are_get_recipes_keywords(label, kwargs):
    name = label.partition("[")[0]
    assert get_recipe(label) == get_recipe(name, **kwargs)
    assert get_recipe(recipe_label(label)) == get_recipe(label)  # the canonical label means the same recipe
    assert split_recipe_label(label) == (name, kwargs.get("fp8", {}).get("granularity"))


def test_canonical_label_orders_and_names_the_options():
    assert recipe_label(" BF16-Master[Master_Remainders, State_Dtype=8BIT] ") == \
        "bf16-master[state_dtype=8bit,master_remainders]"
    assert recipe_label("bf16-sr[state_dtype=bf16]") == "bf16-sr[state_dtype=bfloat16]"
    assert parse_recipe_label("bf16-sr") == ("bf16-sr", {})


@pytest.mark.parametrize("label, words", [
    ("bf16-sr[foo]", ["'foo'", "state_dtype=", "master_remainders", *STATE_DTYPES]),
    ("bf16-sr[state_dtype=int4]", ["'int4'", *STATE_DTYPES]),
    ("bf16-sr[state_dtype=bf16,state_dtype=fp32]", ["more than once"]),
    ("32-true[state_dtype=bfloat16]", ["bf16-kahan", "bf16-sr"]),  # the recipe's own refusal
    ("bf16-kahan[master_remainders]", ["bf16-master"]),
])
def test_bad_state_options_say_what_is_valid(label, words):
    for call in (get_recipe, recipe_label):
        with pytest.raises(RecipeError) as info:
            call(label)
        assert all(w in str(info.value) for w in words), str(info.value)


def test_state_option_given_twice_differently_is_refused():
    with pytest.raises(RecipeError, match="once"):
        get_recipe("bf16-sr[state_dtype=bfloat16]", state_dtype="float32")
    with pytest.raises(RecipeError, match="once"):
        get_recipe("bf16-master[master_remainders]", master_remainders=False)
    label = "bf16-sr[state_dtype=bfloat16]"
    assert get_recipe(label, state_dtype="bf16") == get_recipe(label)
