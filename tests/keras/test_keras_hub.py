"""keras_hub backbones nobody here wrote, built from their configs (GPT-2, BERT, Llama; random init):
every recipe trains them, computes their matmuls in low precision at least as much as Keras' own
``mixed_*`` policy less the FP32 regions keras_ext declares, and ends within the bf16 noise of Keras'
own policy from the same initial weights; FP32 regions declared by op hold inside the composite
layers; the policies of nested layers and the FP8 state survive a ``.keras`` round trip."""

from __future__ import annotations

import numpy as np
import pytest

keras = pytest.importorskip("keras")
pytest.importorskip("keras_hub")
from keras import ops  # noqa: E402

import keras_ext  # noqa: E402
from keras_ext.layers import walk  # noqa: E402
from mp_callbacks import PolicyError, PrecisionPolicy  # noqa: E402
from mp_callbacks.recipes import RECIPE_NAMES  # noqa: E402
from tests.keras.helpers import keras_hub_models as hub  # noqa: E402

# One worker runs the file (`--dist loadgroup`): Keras' own runs are computed once and shared by the recipes.
pytestmark = [pytest.mark.skipif(keras.backend.backend() != "tensorflow", reason="the TensorFlow backend"),
              pytest.mark.xdist_group("keras_hub")]

LOSS_RTOL = 2.0**-8  # bf16's unit roundoff: the noise of a loss computed in bf16
DECLARED = ("a model output", "module rule", "inside an FP32 layer")  # FP32 by a rule of ours, not by accident
_NATIVE: dict[str, tuple] = {}


def native(policy: str) -> tuple:
    """Keras' own run under ``policy`` (computed once per process)."""
    if policy not in _NATIVE:
        _NATIVE[policy] = hub.train(policy)
    return _NATIVE[policy]


def kernel_sizes(model) -> dict[str, int]:
    return {p: int(np.prod(layer.kernel.shape)) for p, layer in walk(model)
            if isinstance(layer, (keras.layers.Dense, keras.layers.EinsumDense)) and layer.built}


def layer_policies(model) -> list[tuple]:
    """Per layer in walk order (nested models and inputs, which compute nothing, aside): class, the policy it
    computes with, its variables' dtypes (FP8 state included)."""
    from keras_ext.layers import own_variables, policy_layers, resolved_policy

    return [(type(layer).__name__, resolved_policy(layer).name,
             tuple(keras.backend.standardize_dtype(v.dtype) for v in own_variables(layer)))
            for _, layer in policy_layers(model)]


def declared_fp32_share(model, recipe: str, under: str = "") -> float:
    """The matmul kernels (below path ``under``) that keras_ext keeps in FP32 by a declared rule (the model's
    outputs, module rules), over all of them."""
    sizes = {p: n for p, n in kernel_sizes(model).items() if p.startswith(under)}
    rows = {r["path"]: r for r in keras_ext.policy_report(model, recipe)}
    declared = sum(n for p, n in sizes.items() if rows[p]["compute"] == "float32"
                   and rows[p]["why"].startswith(DECLARED))
    return declared / sum(sizes.values())


@pytest.mark.parametrize("recipe", RECIPE_NAMES)
def test_every_recipe_trains_three_families_like_keras_own_policy(recipe):
    model, loss = hub.train(recipe)
    theirs, their_loss = native(hub.native_of(recipe))
    ours_bb, their_bb = hub.backbones(model), hub.backbones(theirs)
    for family in hub.FAMILIES:
        assert np.isfinite(loss[family]), family
        if recipe == "32-true":
            np.testing.assert_allclose(loss[family], their_loss[family], rtol=1e-6)
            continue
        share, native_share = (keras_ext.low_precision_share(m[family]) for m in (ours_bb, their_bb))
        assert native_share == 1.0
        assert share >= native_share - declared_fp32_share(model, recipe, ours_bb[family].name), (family, share)
        assert abs(loss[family] - their_loss[family]) <= LOSS_RTOL * abs(their_loss[family]), (family, loss)
    whole, fp32 = keras_ext.low_precision_share(model, paths=True)[0::2]
    if recipe != "32-true":  # the LM heads produce the outputs: FP32 by output=float32, and only they
        assert sorted(fp32) == sorted(f"{f}_head" for f in hub.FAMILIES)
        assert whole >= keras_ext.low_precision_share(theirs) - declared_fp32_share(model, recipe)
    stores = {keras.backend.standardize_dtype(v.dtype) for v in ours_bb["gpt2"].trainable_variables}
    low = {"16-master": "float16"}.get(recipe, "bfloat16")
    if model.optimizer.master_weights or model.optimizer.update_rounding is not None:
        assert stores == {"float32", low}  # dense kernels in low precision, norms and embeddings FP32
        dense = [x for _, x in walk(ours_bb["gpt2"]) if isinstance(x, (keras.layers.Dense, keras.layers.EinsumDense))]
        assert {keras.backend.standardize_dtype(x.kernel.dtype) for x in dense} == {low}
    if recipe == "fp8-mixed":
        from keras_ext.fp8 import fp8_layers

        assert {p.rsplit(".", 1)[-1] for p, _ in fp8_layers(ours_bb["llama"])} >= {"query", "key", "value",
                                                                                   "attention_output"}


def test_fp32_regions_hold_inside_composites_even_when_the_composite_is_declared_low():
    """The issue's GPT-2 backbone: its TransformerDecoder (a layer keras_ext does not know) computes in bf16,
    every Dense/EinsumDense in it too; the softmax inside the attention and the norms stay FP32 and hand bf16
    back, also with a rule declaring the decoder bf16; an FP32 rule on the decoder keeps all of it FP32.
    (With dropout the attention calls its Softmax layer; without, Keras' fused attention computes the
    softmax in FP32 itself.)"""
    keras_ext.set_global_policy("bf16-master")
    keras.utils.set_random_seed(0)
    bb = keras_ext.apply_policy(hub.backbone("gpt2", dropout=0.1))
    rows = {r["path"]: r for r in keras_ext.policy_report(bb)}
    dense = [p for p, x in walk(bb) if isinstance(x, (keras.layers.Dense, keras.layers.EinsumDense))]
    assert len(dense) == 6 and all(rows[p]["compute"] == rows[p]["storage"] == "bfloat16" for p in dense)
    softmax = next(p for p in rows if rows[p]["class"] == "Softmax")
    assert rows[softmax]["compute"] == "float32" and "outputs cast to bfloat16" in rows[softmax]["why"]
    assert rows["transformer_layer_0"]["compute"] == "bfloat16"
    assert rows["transformer_layer_0.self_attention_layer_norm"]["storage"] == "float32"
    x = {"token_ids": np.ones((2, hub.SEQ), "int32"), "padding_mask": np.ones((2, hub.SEQ), "int32")}
    seen = {}
    layer = dict(walk(bb))[softmax]
    call = layer.call
    layer.call = lambda *a, **k: seen.setdefault("out", call(*a, **k))
    y = bb(x)
    assert keras.backend.standardize_dtype(seen["out"].dtype) == "bfloat16"  # FP32 softmax, bf16 handed back
    assert keras.backend.standardize_dtype(y.dtype) == "float32" and np.isfinite(ops.convert_to_numpy(y)).all()
    base = keras_ext.get_global_policy()
    low_rule = PrecisionPolicy(params="bfloat16", compute="bfloat16", output="float32",
                               module_rules=(("TransformerDecoder", "bfloat16"),))
    ruled = {r["path"]: r for r in keras_ext.policy_report(bb, low_rule)}
    assert ruled["transformer_layer_0"]["why"] == "module rule 'TransformerDecoder'"
    assert ruled[softmax]["compute"] == "float32"  # the op's FP32 rule holds inside the declared composite
    fp32 = {r["path"]: r for r in keras_ext.policy_report(bb, base.with_fp32_modules("transformer_layer_0"))}
    inside = [p for p in fp32 if p.startswith("transformer_layer_0.")]
    assert all(fp32[p]["compute"] == "float32" for p in inside)
    assert "outputs cast to bfloat16" not in fp32["transformer_layer_0"]["why"]  # graph-connected: no cast


def test_a_master_recipe_trains_keras_hub_weights_in_low_precision_with_masters():
    """bf16-master on GPT-2 and BERT: every Dense/EinsumDense stores and computes bf16 (was 0 of 13), with an
    FP32 master each, and the masters start at the FP32 draw."""
    model = hub.build("bf16-master", families=("gpt2", "bert"))
    reference = hub.build("native:float32", families=("gpt2", "bert"))
    model.compile(hub.optimizer("bf16-master"), hub.losses(("gpt2", "bert")), run_eagerly=True)
    model.optimizer.build(model.trainable_variables)
    masters = {id(v): m for v, m in zip(model.trainable_variables, model.optimizer.master_variables)}
    for bb in hub.backbones(model).values():
        dense = [x for _, x in walk(bb) if isinstance(x, (keras.layers.Dense, keras.layers.EinsumDense))]
        assert dense and all(keras.backend.standardize_dtype(x.kernel.dtype) == "bfloat16"
                             and x.compute_dtype == "bfloat16" and masters[id(x.kernel)] is not None for x in dense)
    for v, r in zip(model.trainable_variables, reference.trainable_variables, strict=True):
        exact = ops.convert_to_numpy(r)
        got = ops.convert_to_numpy(masters[id(v)] if masters[id(v)] is not None else v)
        np.testing.assert_array_equal(np.asarray(got, "float32"), exact)


def test_keras_round_trip_keeps_nested_policies_fp8_state_and_the_run(tmp_path, recipe="fp8-mixed"):
    """``.keras`` twice under fp8-mixed: every nested layer's policy (LayerNorms and embeddings FP32 with FP32
    variables, softmax FP32, the bf16 attention and MLP kernels) and the FP8 state of each projection come
    back, and the continued run equals the uninterrupted one bit for bit (every recipe: test_saving.py)."""
    families = ("gpt2",)
    x, y = hub.batch(families=families)

    def step(model, i):
        part = slice(2 * (i % 2), 2 * (i % 2) + 2)
        model.train_on_batch({k: v[part] for k, v in x.items()}, {k: v[part] for k, v in y.items()})

    def fresh():
        model = hub.build(recipe, families=families)
        model.compile(hub.optimizer(recipe), hub.losses(families), run_eagerly=True)
        return model

    reference = fresh()
    for i in range(3):
        step(reference, i)
    model = fresh()
    step(model, 0)
    policies = layer_policies(model)
    assert ("LayerNormalization", "float32", ("float32", "float32")) in policies  # inside the decoder too
    for i in (1, 2):
        keras_ext.save_model(model, tmp_path / f"m{i}.keras")
        model = keras_ext.load_model(tmp_path / f"m{i}.keras")
        assert layer_policies(model) == policies
        step(model, i)
    with pytest.raises(PolicyError, match="keras_ext.load_model"):  # Keras' own loader says what to use
        keras.models.load_model(tmp_path / "m1.keras")
    for a, b in zip(reference.weights + reference.optimizer.variables, model.weights + model.optimizer.variables,
                    strict=True):
        np.testing.assert_array_equal(ops.convert_to_numpy(a), ops.convert_to_numpy(b), err_msg=a.path)
