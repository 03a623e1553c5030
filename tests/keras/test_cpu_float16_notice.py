"""Keras: a float16 policy set up on a CPU whose float16 matmuls are slow in the active backend warns once per
process (the core decides: :func:`mp_callbacks.advice.cpu_float16_notice` with backend ``"keras/<backend>"`` and
its measured slowdown, as the Lightning adapter's notice does with torch's); bfloat16 and FP32 policies, CPUs with
native float16 kernels and GPUs do not.  With the measured figures (Keras' backends compute float16 matmuls on
CPU at about float32's speed) it says nothing; the tests that expect a warning give the active backend torch's
measured slowdown, as on a CPU where its float16 matmul were slow."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import pytest

keras = pytest.importorskip("keras")

import keras_ext  # noqa: E402
import keras_ext.global_policy as global_policy  # noqa: E402
from mp_callbacks.advice import (  # noqa: E402
    BFLOAT16_CPU_FEATURES,
    FLOAT16_CPU_FEATURES,
    FLOAT16_CPU_SLOW,
    FLOAT16_CPU_SLOWDOWNS,
    cpu_float16_notice,
)
from tests.keras.helpers.util import ROOT  # noqa: E402

NO_FP16 = {"avx2", "f16c", "fma"}  # the CPU of the measurement (AMD EPYC): no AMX-FP16, no AVX512-FP16
BACKEND = f"keras/{keras.backend.backend()}"


@pytest.fixture
def cpu(monkeypatch):
    """A CPU without native float16 kernels, the model on it, and nothing said yet in this process."""
    monkeypatch.setattr(global_policy, "cpu_flags", lambda: set(NO_FP16))
    monkeypatch.setattr(global_policy, "compute_device", lambda: "cpu")
    monkeypatch.setattr(global_policy, "_NOTICED", [])
    return monkeypatch


@pytest.fixture
def slow(cpu):
    """:func:`cpu`, where the active backend's float16 matmul is as slow as torch's (measured: 47x)."""
    cpu.setitem(FLOAT16_CPU_SLOWDOWNS, BACKEND, FLOAT16_CPU_SLOWDOWNS["torch"])
    return cpu


def _mlp():
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dense(1)])


def _notices(*setups) -> list[str]:
    """The float16-on-CPU warnings of running each of ``setups`` (callables) in turn."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for setup in setups:
            setup()
    return [str(w.message) for w in caught if "computes in float16 on a CPU" in str(w.message)]


@pytest.mark.parametrize("recipe", ["16-mixed", "16-master", "mixed_float16"])
def test_float16_on_a_slow_cpu_warns_once_per_process_with_the_cause(recipe, slow):
    notices = _notices(lambda: keras_ext.set_global_policy(recipe), lambda: keras_ext.apply_policy(_mlp()),
                       lambda: keras_ext.set_global_policy("16-master"),
                       lambda: keras_ext.apply_policy(_mlp(), "16-mixed"))
    name = keras_ext.resolve_policy(recipe)[1].name  # "mixed_float16": the recipe of that alias
    assert notices == [f"keras_ext: {cpu_float16_notice(name, 'float16', 'cpu', NO_FP16, BACKEND)}"]
    assert "AMX-FP16" in notices[0] and BACKEND in notices[0] and "x float32's" in notices[0]


def test_keras_own_mixed_float16_warns_when_apply_policy_puts_it_in_place(slow):
    keras.config.set_dtype_policy("mixed_float16")  # Keras' own call: keras_ext hears of it at apply_policy
    notices = _notices(lambda: keras_ext.apply_policy(_mlp()), lambda: keras_ext.apply_policy(_mlp()))
    assert notices == [f"keras_ext: {cpu_float16_notice('the dtype policy', 'float16', 'cpu', NO_FP16, BACKEND)}"]


def test_other_policies_do_not_warn_nor_use_up_the_notice(slow):
    others = [lambda r=r: keras_ext.apply_policy(_mlp(), r) for r in ("bf16-mixed", "bf16-master", "32-true")]
    assert _notices(*others) == []
    assert len(_notices(lambda: keras_ext.set_global_policy("16-mixed"))) == 1  # said once float16 comes


@pytest.mark.parametrize("feature", FLOAT16_CPU_FEATURES)
def test_a_cpu_with_native_float16_does_not_warn(feature, slow):
    slow.setattr(global_policy, "cpu_flags", lambda: NO_FP16 | {feature})
    assert _notices(lambda: keras_ext.set_global_policy("16-mixed")) == []


def test_a_gpu_does_not_warn(slow):
    slow.setattr(global_policy, "compute_device", lambda: "gpu")
    assert _notices(lambda: keras_ext.set_global_policy("16-mixed")) == []


def test_the_measured_figures_say_nothing_on_keras(cpu):
    """Keras' float16 matmul on CPU measured about float32's speed on every backend: no notice to give."""
    assert all(FLOAT16_CPU_SLOWDOWNS[f"keras/{b}"] < FLOAT16_CPU_SLOW for b in ("tensorflow", "jax", "torch"))
    assert _notices(lambda: keras_ext.set_global_policy("16-mixed"), lambda: keras_ext.apply_policy(_mlp())) == []


def test_the_core_rule_per_backend():
    assert cpu_float16_notice("16-mixed", "float16", "cpu", NO_FP16, "keras/tensorflow") is None  # ~1x
    assert cpu_float16_notice("16-mixed", "float16", "cpu", NO_FP16, "numpy") is None  # no figure
    said = cpu_float16_notice("16-mixed", "float16", "cpu", NO_FP16, "torch")
    assert said is not None and f"~{FLOAT16_CPU_SLOWDOWNS['torch']:g}x" in said and "32-true" in said
    with_bf16 = cpu_float16_notice("16-mixed", "float16", "cpu", NO_FP16 | {BFLOAT16_CPU_FEATURES[1]}, "torch")
    assert with_bf16 is not None and "Use bf16-mixed on this CPU" in with_bf16


_DEVICE_OF = {
    "tensorflow": "import tensorflow as tf; want = 'gpu' if tf.config.list_physical_devices('GPU') else 'cpu'",
    "jax": "import jax; want = jax.default_backend()",
    "torch": "import torch; want = 'cuda' if torch.cuda.is_available() else 'cpu'",
}
"""Per backend: the framework's own answer to where it computes by default (``want``)."""


def test_the_device_is_the_backend_s_default():
    """:func:`keras_ext.global_policy.compute_device` on this process's backend, against the framework's answer."""
    scope: dict = {}
    exec(_DEVICE_OF[keras.backend.backend()], scope)
    assert global_policy.compute_device() == scope["want"]


@pytest.mark.slow  # three fresh processes (~45 s here); the test above covers the running backend
@pytest.mark.parametrize("backend", sorted(_DEVICE_OF))
def test_the_device_is_the_backend_s_default_on_every_backend(backend, tmp_path):
    """The same on each backend, a fresh process each (the backend is fixed at keras' import)."""
    pytest.importorskip(backend)
    code = f"from keras_ext.global_policy import compute_device; {_DEVICE_OF[backend]}; print(compute_device(), want)"
    env = {**os.environ, "KERAS_BACKEND": backend, "PYTHONPATH": str(ROOT), "TF_CPP_MIN_LOG_LEVEL": "2"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path,
                          check=False, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got, want = proc.stdout.split()[-2:]
    assert got == want
