"""How much slower float16 (and bfloat16) matmuls are than float32 on this CPU, one thread, per framework.

The figures behind the adapters' float16-on-CPU warning (:func:`mp_callbacks.advice.cpu_float16_notice`,
:data:`mp_callbacks.advice.FLOAT16_CPU_SLOWDOWNS`): CPUs without AMX-FP16 / AVX512-FP16 have no native
float16 matmul kernel, and a framework's fallback can be tens of times slower than float32.

Timed: torch's, TensorFlow's and JAX's own matmuls, and ``keras.ops.matmul`` (what ``Dense`` calls) on each
Keras backend (Keras' torch backend computes a float16 matmul on CPU in float32).  Each runs in a fresh
subprocess, its thread settings made before its first op: torch ``set_num_threads(1)``, TensorFlow
``set_intra_op_parallelism_threads(1)`` (and inter-op 1), JAX ``XLA_FLAGS=--xla_cpu_multi_thread_eigen=false
intra_op_parallelism_threads=1``.  In each of three rounds float32, float16, bfloat16 and float32 again (the
control: the same work timed twice) take turns, the least of 20 calls each; the ratios are to the lesser
float32 timing, and the least of the three rounds is reported (other jobs on the machine only ever slow a
run down) with the rounds' min-max.

Run: ``PYTHONPATH=. python benchmarks/bench_cpu_float16.py [N] [TF_N]`` (N: the matrix size, 512; TF_N:
TensorFlow's, 256, kept modest since its float16 matmul can take a slow path on other CPUs).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from mp_callbacks.advice import cpu_flags
from mp_callbacks.app.machine import FRAMEWORKS, cpu_model, features, least_times, matmul_slowdown

ROUNDS = 3
REPEATS = 20  # calls per dtype and round, the least counts: a loaded machine interrupts some
_TF = {"TF_CPP_MIN_LOG_LEVEL": "2"}
_JAX = {"XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1", "JAX_PLATFORMS": "cpu"}
ENV = {"torch": {}, "tensorflow": _TF, "jax": _JAX, "keras/tensorflow": {**_TF, "KERAS_BACKEND": "tensorflow"},
       "keras/jax": {**_JAX, "KERAS_BACKEND": "jax"}, "keras/torch": {"KERAS_BACKEND": "torch"}}
"""Each framework's environment: what must be set before it is imported."""


POLICIES = ("float32", "mixed_float16", "mixed_bfloat16", "float32")  # the last: the control


def keras_steps(repeats: int) -> list[float]:
    """``train_on_batch`` of a Dense-ReLU MLP (64 -> 512 -> 512 -> 10, batch 128, Adam) under each of
    :data:`POLICIES`, Keras' defaults otherwise (on TensorFlow/CPU: no XLA, Grappler's remapper on), taking
    turns; the least of ``repeats`` steps each."""
    import keras
    import numpy as np

    if keras.backend.backend() == "torch":  # one thread, as for its matmuls (TensorFlow's stays set; JAX: XLA_FLAGS)
        import torch

        torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(128, 64)).astype("float32"), rng.integers(0, 10, 128)
    models = []
    for policy in POLICIES:
        keras.config.set_dtype_policy(policy)
        model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(512, activation="relu"),
                                  keras.layers.Dense(512, activation="relu"), keras.layers.Dense(10, dtype="float32")])
        model.compile(keras.optimizers.Adam(1e-3), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        models.append(model)
    keras.config.set_dtype_policy("float32")
    return least_times([lambda m=m: m.train_on_batch(x, y) for m in models], repeats)


def child(framework: str, n: int) -> None:
    """One framework's rounds, printed as JSON ``{name: [ratio per round]}`` (Keras: its MLP step's too)."""
    rounds = [matmul_slowdown(n, repeats=REPEATS, framework=framework, control=True) for _ in range(ROUNDS)]
    if framework.startswith("keras/") and rounds[0]:
        for r in rounds:
            f32, f16, bf16, again = keras_steps(REPEATS)
            base = min(f32, again)
            r.update({"MLP step float16": f16 / base, "MLP step bfloat16": bf16 / base,
                      "MLP step control": again / f32})
    print(json.dumps({k: [r[k] for r in rounds] for k in rounds[0]} if rounds[0] else {}))


def main(n: int = 512, tf_n: int = 256) -> None:
    found = features(cpu_flags())
    print(f"CPU: {cpu_model()}; {os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f}; "
          + ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in found.items()))
    for framework in FRAMEWORKS:
        size = tf_n if framework.endswith("tensorflow") else n
        proc = subprocess.run([sys.executable, __file__, "--child", framework, str(size)], capture_output=True,
                              text=True, env={**os.environ, **ENV[framework]}, check=False)
        if proc.returncode != 0:
            print(f"{framework}: failed: {proc.stderr.strip().splitlines()[-1:]}")
            continue
        ratios = json.loads(proc.stdout.strip().splitlines()[-1])
        if not ratios:
            print(f"{framework}: not installed")
            continue
        print(f"{framework}, {size}x{size} matmul, 1 thread, time / float32's (least of {ROUNDS}, min-max): "
              + ", ".join(f"{k} {min(v):.2f}x ({min(v):.2f}-{max(v):.2f})" for k, v in ratios.items()))
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        child(sys.argv[2], int(sys.argv[3]))
    else:
        main(*(int(a) for a in sys.argv[1:3]))
