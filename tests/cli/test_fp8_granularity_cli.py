"""``mpx compare --fp8-granularity``: the built-in task once per FP8 granularity, a row ``fp8-mixed[KIND]`` each."""

import json

import pytest

from mp_callbacks.app import cli
from mp_callbacks.fp8 import GRANULARITIES
from mp_callbacks.recipes import get_recipe


def test_variants_replace_fp8_mixed_where_it_stands():
    labels = cli.fp8_variants(["32-true", "bf16-mixed", "fp8-mixed", "bf16-sr"], ["mxfp8", "rowwise"])
    assert labels == ["32-true", "bf16-mixed", "fp8-mixed[mxfp8]", "fp8-mixed[rowwise]", "bf16-sr"]
    assert cli.fp8_variants(["bf16-mixed"], ["rowwise"]) == ["bf16-mixed", "fp8-mixed[rowwise]"]
    assert cli.fp8_variants(["mixed_bfloat16", "fp8-mixed[blockwise]"], None) == ["bf16-mixed", "fp8-mixed[blockwise]"]


def test_bad_granularity_lists_the_valid_ones(capsys):
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["compare", "--fp8-granularity", "rowwise", "colwise"])
    err = capsys.readouterr().err
    assert "'colwise'" in err and all(kind in err for kind in GRANULARITIES), err


@pytest.mark.parametrize("label", ["fp8-mixed[colwise]", "bf16-mixed[rowwise]"])
def test_bad_label_in_recipes_lists_the_valid_ones(label):
    with pytest.raises(SystemExit) as info:
        cli.main(["compare", "--recipes", label, "--steps", "2"])
    assert str(info.value).startswith("mpx compare: error:") and all(k in str(info.value) for k in GRANULARITIES)


OWN = {  # one own model per framework: the factories mpx compare is given (the keras_hub GPT-2 of
    # examples/compare_keras_hub.py takes ~100 s here under mxfp8: a Dense model stands in for it)
    "lightning": ("--lightning", "examples.compare_hf_gpt2:make_module", "--datamodule",
                  "examples.compare_hf_gpt2:make_datamodule"),
    "keras": ("--keras", "tests.cli.own_models:build_keras_mlp", "--data", "tests.cli.own_models:make_keras_arrays",
              "--batch-size", "16"),
}


@pytest.mark.parametrize("framework", ["lightning", "keras"])
def test_own_model_trains_each_granularity(framework, tmp_path, monkeypatch):
    """``--fp8-granularity`` on your own model: a row ``fp8-mixed[KIND]`` whose run trained the recipe
    ``fp8={"granularity": KIND}`` gives (what the adapter was handed is recorded)."""
    trained = []
    if framework == "lightning":
        pytest.importorskip("transformers")
        from mp_callbacks.app import lightning_model

        class Recording(lightning_model.MixedPrecision):
            def __init__(self, *args, **kwargs):
                super().__init__(*args, **kwargs)
                trained.append(self.recipe)

        monkeypatch.setattr(lightning_model, "MixedPrecision", Recording)
    else:
        pytest.importorskip("keras")
        from mp_callbacks.app import keras_model

        real = keras_model.keras_policy.set_global_policy
        monkeypatch.setattr(keras_model.keras_policy, "set_global_policy", lambda r: (trained.append(r), real(r))[1])
    cli.main(["compare", *OWN[framework], "--recipes", "fp8-mixed", "--fp8-granularity", "mxfp8", "--steps", "3",
              "--threads", "1", "--in-process", "--quiet", "--out", str(tmp_path)])
    data = json.loads((tmp_path / "results.json").read_text())
    rows = [r for r in data["results"] if not r["control"]]
    assert [r["recipe"] for r in rows] == ["32-true", "fp8-mixed[mxfp8]"]
    assert all(r["error"] is None for r in rows), [r["error"] for r in rows]
    assert (tmp_path / f"{framework}_fp8-mixed[mxfp8].jsonl").is_file()
    fp8 = [r.fp8 for r in trained if getattr(r, "fp8", None) is not None]
    assert fp8 == [get_recipe("fp8-mixed", fp8={"granularity": "mxfp8"}).fp8]


KINDS = ("tensorwise", "mxfp8")  # the default kind and a finer one (every kind: tests/core/test_recipe_labels.py)


@pytest.mark.parametrize("framework", ["lightning", "keras"])
def test_builtin_task_trains_each_granularity(framework, tmp_path, monkeypatch):
    """Each row is labelled with its granularity and its run trained the recipe ``fp8={"granularity": KIND}``
    gives (what the adapter was handed is recorded)."""
    trained = []
    if framework == "lightning":
        pytest.importorskip("lightning")
        from mp_callbacks.app import lightning_runner

        class Recording(lightning_runner.MixedPrecision):
            def __init__(self, *args, **kwargs):
                super().__init__(*args, **kwargs)
                trained.append(self.recipe)

        monkeypatch.setattr(lightning_runner, "MixedPrecision", Recording)
    else:
        pytest.importorskip("keras")
        from mp_callbacks.app import keras_runner

        real = keras_runner.set_global_policy
        monkeypatch.setattr(keras_runner, "set_global_policy", lambda r: (trained.append(r), real(r))[1])
    cli.main(["compare", "--frameworks", framework, "--recipes", "fp8-mixed", "--fp8-granularity", *KINDS,
              "--steps", "3", "--hidden", "16", "--batch-size", "16", "--threads", "1", "--in-process", "--quiet",
              "--out", str(tmp_path)])
    rows = [r for r in json.loads((tmp_path / "results.json").read_text())["results"] if not r["control"]]
    assert [r["recipe"] for r in rows] == ["32-true", *(f"fp8-mixed[{k}]" for k in KINDS)]
    assert all(r["error"] is None for r in rows), [r["error"] for r in rows]
    fp8 = [r.fp8 for r in trained if r.fp8 is not None]
    assert fp8 == [get_recipe("fp8-mixed", fp8={"granularity": k}).fp8 for k in KINDS]
