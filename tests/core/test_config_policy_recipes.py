"""Validation, policy resolution, recipes, memory accounting and history I/O."""

from __future__ import annotations

import subprocess
import sys

import pytest

from mp_callbacks import (
    ConfigError,
    History,
    MasterPlan,
    PolicyError,
    PrecisionPolicy,
    RecipeError,
    ScalerConfig,
    StepStats,
    bytes_per_param,
    estimate_memory,
    get_recipe,
)
from mp_callbacks.diagnostics import METRICS, plot


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("init_scale", 0.0, r"init_scale=0\.0 is invalid: must be in \[min_scale"),
        ("init_scale", float("inf"), "init_scale=inf is invalid: must be a finite number"),
        ("init_scale", "big", "init_scale='big'"),
        ("growth_factor", 1.0, "growth_factor=1.0 is invalid: must be > 1"),
        ("backoff_factor", 1.0, r"backoff_factor=1.0 is invalid: must be in the open interval \(0, 1\)"),
        ("backoff_factor", 0.0, "backoff_factor=0.0"),
        ("growth_interval", 0, "growth_interval=0 is invalid: must be an integer >= 1"),
        ("growth_interval", 2.5, "growth_interval=2.5"),
        ("hysteresis", 0, "hysteresis=0"),
        ("hysteresis", True, "hysteresis=True"),
        ("min_scale", 0.0, r"min_scale=0.0 is invalid: must be >= 1.17549e-38 \(2\*\*-126"),
        ("min_scale", 2.0**-130, "min_scale=7.3"),
        ("max_scale", 1e39, "max_scale=1e\\+39 is invalid: must be <= float32 max"),
        ("max_scale", 0.5, r"init_scale=65536.0 is invalid: must be in \[min_scale, max_scale\] = \[1.17"),
        ("on_min_scale", "explode", "on_min_scale='explode' is invalid: must be one of clamp, warn, raise"),
        ("enabled", "yes", "enabled='yes' is invalid: must be True or False"),
        ("consecutive_hysteresis", 1, "consecutive_hysteresis=1"),
    ],
)
def test_invalid_config_names_field_value_and_range(field, value, message):
    with pytest.raises(ConfigError, match=message):
        ScalerConfig(**{field: value})


def test_max_below_min_is_named():
    with pytest.raises(ConfigError, match="max_scale=2.0 is invalid: must be >= min_scale"):
        ScalerConfig(min_scale=4.0, max_scale=2.0, init_scale=2.0)


def test_presets_and_errors():
    assert ScalerConfig.preset("torch").init_scale == 2.0**16
    assert ScalerConfig.preset("keras").init_scale == 2.0**15
    assert ScalerConfig.preset("megatron").hysteresis == 2
    assert ScalerConfig.preset("deepspeed").growth_interval == 1000
    assert ScalerConfig.preset("apex").max_scale == 2.0**24
    with pytest.raises(ConfigError, match="unknown scaler preset 'pytorch'; valid presets: apex, deepspeed"):
        ScalerConfig.preset("pytorch")
    with pytest.raises(ConfigError, match="unknown ScalerConfig field"):
        ScalerConfig.from_dict({"scale": 1})
    with pytest.raises(ConfigError, match="not int"):
        ScalerConfig.coerce(3)
    cfg = ScalerConfig.preset("megatron")
    assert ScalerConfig.from_dict(cfg.to_dict()) == cfg


def test_policy_parse_format_and_resolve():
    p = PrecisionPolicy.parse("params=float32,compute=bf16,output=float32")
    assert p.format() == "params=float32,compute=bfloat16,output=float32"
    assert PrecisionPolicy.parse(p.format()) == p
    assert p.resolve("linear") == "bfloat16"
    assert p.resolve("Linear") == "bfloat16"
    assert p.resolve("Dense") == "bfloat16"
    assert p.resolve("softmax") == "float32"
    assert p.resolve("LayerNormalization") == "float32"
    assert p.resolve("relu") == "bfloat16"  # follows its input
    assert p.resolve("MyCustomOp") == "float32"  # unknown -> FP32

    class FancyAttention:  # a custom module class
        pass

    assert p.resolve(FancyAttention()) == "float32"
    declared = PrecisionPolicy(compute="bfloat16", low_precision_ops=p.low_precision_ops | {"fancyattention"})
    assert declared.resolve(FancyAttention()) == "bfloat16"
    ruled = p.with_fp32_modules("encoder.*.attn", "Linear")
    assert ruled.resolve("Linear", "head") == "float32"
    assert ruled.resolve("Conv2d", "encoder.0.attn") == "float32"
    assert ruled.resolve("Conv2d", "encoder.0.mlp") == "bfloat16"
    assert ruled.keeps_fp32("Conv2d", "encoder.3.attn")
    assert not PrecisionPolicy().keeps_fp32("softmax")  # fp32 compute keeps nothing special
    assert PrecisionPolicy.from_dict(ruled.to_dict()) == ruled


@pytest.mark.parametrize(
    "text,message",
    [
        ("", "non-empty"),
        ("params=float32,compute", "'compute' is not key=dtype"),
        ("weights=float32", "unknown key 'weights'; valid keys: params, compute, output"),
        ("compute=float8", "compute='float8' is not a supported dtype; valid: float32, float16, bfloat16"),
        ("compute=bf16,compute=fp16", "'compute' given twice"),
    ],
)
def test_invalid_policy_strings(text, message):
    with pytest.raises(PolicyError, match=message):
        PrecisionPolicy.parse(text)


def test_a_composite_computes_what_it_holds_and_casts_meet_at_its_boundary():
    from mp_callbacks.policy import boundary_cast

    p = PrecisionPolicy(params="float32", compute="bfloat16", output="float32")
    assert p.explain_composite("TransformerDecoder", "block", ["bfloat16", "float32"]) == (
        "bfloat16", "TransformerDecoder holds sublayers computing in bfloat16: computes like them")
    assert p.explain_composite("Block", "block", ["float32"]) == ("float32", "Block holds only FP32 sublayers")
    assert p.explain_composite("MultiHeadAttention", "mha", []) == ("bfloat16", "attention: low-precision op")
    ruled = p.with_fp32_modules("block")
    assert ruled.explain_composite("Block", "block", ["bfloat16"]) == ("float32", "module rule 'block'")
    fp32 = PrecisionPolicy()
    assert fp32.explain_composite("Block", "b", ["float32"])[0] == "float32"
    assert boundary_cast("float32", "bfloat16") == "bfloat16"  # an FP32 softmax hands bf16 back
    assert boundary_cast("bfloat16", "bfloat16") is None and boundary_cast("float32", None) is None


def test_invalid_policy_rules():
    with pytest.raises(PolicyError, match="in both"):
        PrecisionPolicy(low_precision_ops={"softmax"})
    with pytest.raises(PolicyError, match="not the string"):
        PrecisionPolicy(fp32_ops="softmax")
    with pytest.raises(PolicyError, match="module rule"):
        PrecisionPolicy(module_rules=(("Linear",),))
    with pytest.raises(PolicyError, match="unknown policy key"):
        PrecisionPolicy.from_dict({"paramz": "float32"})


def test_recipes():
    r = get_recipe("bf16-master")
    assert (r.policy.params, r.policy.compute, r.master.master_weights, r.scaler.enabled) == (
        "bfloat16", "bfloat16", True, False)
    r = get_recipe("16-mixed")
    assert (r.policy.params, r.policy.compute, r.autocast, r.scaler.enabled) == ("float32", "float16", True, True)
    assert get_recipe("32-true").low_precision is False
    assert get_recipe("mixed_bfloat16").name == "bf16-mixed"
    assert get_recipe("bf16-mixed", scaler="keras").scaler.enabled is True
    assert get_recipe("16-master", policy="params=float16,compute=float16").policy.compute == "float16"
    assert type(r).from_dict(r.to_dict()) == r
    with pytest.raises(RecipeError, match="unknown recipe 'int8-mixed'.*valid recipes: 32-true, 16-mixed"):
        get_recipe("int8-mixed")
    with pytest.raises(RecipeError, match="unknown recipe 16"):
        get_recipe(16)
    with pytest.raises(ConfigError, match="unknown scaler preset"):
        get_recipe("16-mixed", scaler="nope")
    with pytest.raises(RecipeError, match="contradicts recipe 'bf16-master' .params=bfloat16, compute=bfloat16"):
        get_recipe("bf16-master", policy="params=float32,compute=float16")
    ruled = get_recipe("bf16-mixed").policy.with_fp32_modules("head")
    assert get_recipe("bf16-mixed", policy=ruled).policy.module_rules == (("head", "float32"),)


def test_memory_estimates():
    adamw = {name: bytes_per_param(get_recipe(name).master, "adamw") for name in
             ("32-true", "16-mixed", "bf16-master")}
    assert adamw == {"32-true": 16.0, "16-mixed": 16.0, "bf16-master": 16.0}  # 2+2+4+4+4 for master
    est = estimate_memory(get_recipe("bf16-master").master, "AdamW", 10)
    assert (est.weights, est.grads, est.masters, est.optimizer_state) == (20, 20, 40, 80)
    assert bytes_per_param(get_recipe("bf16-master").master, "sgd") == 8.0
    assert bytes_per_param(get_recipe("bf16-master").master, "adamw", fp32_master_grads=True) == 18.0
    assert bytes_per_param(get_recipe("bf16-mixed").master, "adamw", fp32_master_grads=True) == 16.0
    assert bytes_per_param(MasterPlan(), "sgd-momentum") == 12.0
    mixed = estimate_memory(get_recipe("bf16-master").master, "adamw", [(10, "bfloat16"), (10, "float32")])
    assert mixed.masters == 40 and mixed.weights == 20 + 40  # FP32-kept params need no master
    with pytest.raises(ValueError, match="unknown optimizer 'adamz'; known:"):
        bytes_per_param(MasterPlan(), "adamz")
    with pytest.raises(ValueError, match="needs a low-precision param_dtype"):
        MasterPlan(master_weights=True)


def test_history_jsonl_round_trip_and_plot(tmp_path):
    h = History(maxlen=3)
    for i in range(5):
        h.append(StepStats(step=i, scale=2.0**i, overflow=i == 3, overflows_total=int(i >= 3),
                           skipped_total=int(i >= 3), growths_total=i, loss=float("inf") if i == 3 else 1.0 / (i + 1),
                           overflow_module="net.2" if i == 3 else None))
    h.add_event("overflow", step=3, module="net.2", scale=8.0)
    assert len(h) == 3 and [s.step for s in h] == [2, 3, 4]  # bounded
    path = tmp_path / "h.jsonl"
    h.to_jsonl(path)
    back = History.from_jsonl(path)
    assert [s.to_dict() for s in back] == [s.to_dict() for s in h]
    assert list(back.events) == list(h.events)
    assert back[1].loss == float("inf")
    assert set(h[1].metrics()) <= set(METRICS)
    assert h.series("mp/scale") == [4.0, 8.0, 16.0]
    restored = History()
    restored.load_state_dict(h.state_dict())
    assert [s.to_dict() for s in restored] == [s.to_dict() for s in h]
    png = tmp_path / "scale.png"
    plot(h, png, title="test")
    assert png.stat().st_size > 1000
    with pytest.raises(ValueError, match="empty"):
        plot(History(), tmp_path / "empty.png")


def test_core_imports_no_framework():
    """Every module of the core below the app (each subpackage too) imports no framework at module level."""
    code = ("import sys, pkgutil, importlib, mp_callbacks;"
            "names=[m.name for m in pkgutil.walk_packages(mp_callbacks.__path__, 'mp_callbacks.')"
            " if not m.name.startswith('mp_callbacks.app') and m.name != 'mp_callbacks.__main__'];"
            "[importlib.import_module(n) for n in names];"
            "assert len(names) > 25, names;"
            "bad=[m for m in sys.modules if m.split('.')[0] in ('torch','keras','tensorflow','lightning','jax')];"
            "print(bad); sys.exit(1 if bad else 0)")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_tanh_gelu_is_fp32_under_float16_only():
    # Hugging Face's tanh GELU cubes its input (inf in float16 from |x| > 40): an FP32 op under float16
    # compute, a passthrough activation under bfloat16 (FP32's range); a module rule still wins, and the
    # list round-trips through to_dict.
    from mp_callbacks.policy import PrecisionPolicy

    bf16 = PrecisionPolicy.parse("params=float32,compute=bfloat16,output=float32")
    fp16 = PrecisionPolicy.parse("params=float32,compute=float16,output=float32")
    for name in ("NewGELUActivation", "GELUTanh", "FastGELUActivation"):
        assert bf16.resolve(name) == "bfloat16" and not bf16.keeps_fp32(name)
        assert fp16.resolve(name) == "float32" and fp16.keeps_fp32(name)
    assert fp16.resolve("GELUActivation") == "float16"  # the erf GELU stays in range
    assert "passthrough" in bf16.explain("NewGELUActivation")[1] and "FP32" in fp16.explain("NewGELUActivation")[1]
    declared = PrecisionPolicy.parse("params=float32,compute=bfloat16,output=float32",
                                     module_rules=(("NewGELUActivation", "float32"),))
    assert declared.resolve("NewGELUActivation") == "float32"
    assert PrecisionPolicy.from_dict(fp16.to_dict()) == fp16
    old = {k: v for k, v in fp16.to_dict().items() if k != "float16_fp32_ops"}  # a checkpoint from before
    assert PrecisionPolicy.from_dict(old).keeps_fp32("NewGELUActivation")
