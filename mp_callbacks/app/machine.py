"""What this machine's CPU offers for low-precision compute, and what that means for each recipe.

Read from ``/proc/cpuinfo`` (Linux; elsewhere nothing is found and the notes say so).  The
figures that matter are measured (``mpx demo``'s matmul probe, ``mpx compare``'s step times);
the features explain them:

* ``amx_bf16`` / ``amx_fp16``: AMX tiles (Sapphire Rapids and later; fp16 from Granite Rapids):
  oneDNN's bf16 / fp16 matmuls run faster than FP32.
* ``avx512_bf16`` / ``avx512_fp16``: bf16 dot products / fp16 arithmetic in AVX-512: oneDNN has
  native kernels for that dtype (about FP32 speed, more for memory-bound work).
* none of them: no native kernel; torch's bf16/fp16 matmul on CPU takes a fallback path that can be
  tens of times slower than FP32, while TensorFlow's and JAX's run at about FP32's speed there, and
  Keras' torch backend computes float16 matmuls on CPU in float32 (its bfloat16 ones take torch's slow
  path): :func:`matmul_slowdown` measures it.  The recipes still give their memory (bytes/param) and
  their numerics; their speed then describes this CPU only.
"""

from __future__ import annotations

import functools
import time
from typing import Any

from ..advice import cpu_flags  # the reading is the core's (lightning_ext reports from it too)

FEATURES = ("amx_bf16", "amx_fp16", "amx_tile", "avx512_bf16", "avx512_fp16", "avx512f", "avx2", "f16c")
"""The ``/proc/cpuinfo`` flags reported (each found or not)."""

RECIPE_GROUPS = {
    "bfloat16": ("bf16-mixed", "bf16-master", "bf16-kahan", "bf16-sr"),
    "float16": ("16-mixed", "16-master"),
}


def cpu_model() -> str:
    """The ``model name`` of ``/proc/cpuinfo`` ("" when unreadable)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            return next((line.split(":", 1)[1].strip() for line in fh if line.startswith("model name")), "")
    except OSError:  # pragma: no cover - not Linux
        return ""


def features(flags: set[str] | None = None) -> dict[str, bool]:
    """``{feature: found}`` for every name of :data:`FEATURES`."""
    flags = cpu_flags() if flags is None else flags
    return {name: name in flags for name in FEATURES}


def native_kernel(dtype: str, found: dict[str, bool]) -> str:
    """The CPU feature that gives ``dtype`` ("bfloat16" / "float16") native matmul kernels, or "none"."""
    short = "bf16" if dtype == "bfloat16" else "fp16"
    for name in (f"amx_{short}", f"avx512_{short}"):
        if found.get(name):
            return name.upper().replace("_", "-")
    return "none"


def recipe_notes(found: dict[str, bool], slowdown: dict[str, float] | None = None) -> list[str]:
    """One line per compute dtype: which recipes use it, the feature that serves it, the probe's figure."""
    if not any(found.values()):
        return ["CPU features: /proc/cpuinfo not readable here; the step times below are the only guide"]
    lines = ["CPU features: " + ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in found.items())]
    for dtype, recipes in RECIPE_GROUPS.items():
        kernel = native_kernel(dtype, found)
        probe = (f"; probe: {dtype} matmul {slowdown[dtype]:.1f}x float32's time"
                 if slowdown and dtype in slowdown else "")
        if kernel == "none":
            meaning = (f"no native {dtype} matmul on this CPU: {', '.join(recipes)} compute through a slow fallback "
                       "(torch), expect them slower than 32-true; their bytes/param and accuracy still hold")
        elif kernel.startswith("AMX"):
            meaning = f"{kernel}: {', '.join(recipes)} can run matmuls faster than 32-true"
        else:
            meaning = f"{kernel} (no AMX): {', '.join(recipes)} run matmuls at about 32-true's speed"
        lines.append(f"  {dtype}: {meaning}{probe}")
    lines.append("  float32 (32-true, and every FP32 region): FMA" + (" with AVX-512" if found.get("avx512f") else
                                                                       " with AVX2" if found.get("avx2") else ""))
    return lines


def slowdown_notes(found: dict[str, bool]) -> dict[str, str]:
    """``{recipe: why it may be slow here}`` for the recipes whose compute dtype has no native matmul kernel
    on this CPU (nothing when the features are unknown)."""
    if not any(found.values()):
        return {}
    groups = {**RECIPE_GROUPS, "bfloat16": (*RECIPE_GROUPS["bfloat16"], "fp8-mixed")}  # fp8-mixed: bf16 elsewhere
    return {recipe: f"no native {dtype} matmul on this CPU" for dtype, recipes in groups.items()
            if native_kernel(dtype, found) == "none" for recipe in recipes}


FRAMEWORKS = ("torch", "tensorflow", "jax", "keras/tensorflow", "keras/jax", "keras/torch")
"""What :func:`matmul_slowdown` times (each imported inside it: the core stays framework-free): the
frameworks' own matmuls, and ``keras.ops.matmul`` (what ``Dense`` calls) on each Keras backend, which can
differ (Keras' torch backend computes a float16 matmul on CPU in float32)."""

CONTROL = "float32 (control)"
"""The key of the control in :func:`matmul_slowdown`'s answer: a second float32 matmul timed alongside."""


def least_times(calls: list[Any], repeats: int) -> list[float]:
    """Seconds of one call of each of ``calls``: each called once to warm up, then all in turn ``repeats``
    times (alternating, so that a change in the machine's load hits them alike), the least of each."""
    for call in calls:
        call()
    best = [float("inf")] * len(calls)
    for _ in range(repeats):
        for i, call in enumerate(calls):
            start = time.perf_counter()
            call()
            best[i] = min(best[i], time.perf_counter() - start)
    return best


def _torch_times(n: int, repeats: int, dtypes: tuple[str, ...]) -> list[float]:
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        arrays = {d: torch.randn(n, n).to(getattr(torch, d)) for d in set(dtypes)}
        return least_times([lambda a=arrays[d]: a @ a for d in dtypes], repeats)
    finally:
        torch.set_num_threads(threads)


def _tensorflow_one_thread() -> None:
    """One TensorFlow thread, when no op ran yet in this process (one that did keeps its thread pool)."""
    import tensorflow as tf

    try:
        tf.config.threading.set_intra_op_parallelism_threads(1)
        tf.config.threading.set_inter_op_parallelism_threads(1)
    except RuntimeError:
        pass


def _tensorflow_times(n: int, repeats: int, dtypes: tuple[str, ...]) -> list[float]:
    import tensorflow as tf

    _tensorflow_one_thread()
    base = tf.random.normal((n, n), seed=0)
    arrays = {d: tf.cast(base, d) for d in set(dtypes)}
    return least_times([lambda a=arrays[d]: tf.linalg.matmul(a, a).numpy() for d in dtypes], repeats)


def _jax_times(n: int, repeats: int, dtypes: tuple[str, ...]) -> list[float]:
    import jax
    import jax.numpy as jnp

    matmul = jax.jit(lambda a: a @ a)  # one thread: XLA_FLAGS set before jax is imported (the benchmark does)
    base = jax.random.normal(jax.random.key(0), (n, n))
    arrays = {d: base.astype(getattr(jnp, d)) for d in set(dtypes)}
    return least_times([lambda a=arrays[d]: matmul(a).block_until_ready() for d in dtypes], repeats)


def _keras_times(backend: str, n: int, repeats: int, dtypes: tuple[str, ...]) -> list[float]:
    import keras

    if keras.backend.backend() != backend:
        raise ValueError(f"keras runs on {keras.backend.backend()}, not {backend}: set KERAS_BACKEND={backend} "
                         "before keras is imported")
    if backend == "tensorflow":
        _tensorflow_one_thread()
    base = keras.random.normal((n, n), seed=0)
    arrays = {d: keras.ops.cast(base, d) for d in set(dtypes)}
    # One element back to the host: the whole (asynchronous, on JAX) matmul has run.
    calls = [lambda a=arrays[d]: keras.ops.convert_to_numpy(keras.ops.cast(keras.ops.matmul(a, a)[0, 0], "float32"))
             for d in dtypes]
    if backend != "torch":
        return least_times(calls, repeats)
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return least_times(calls, repeats)
    finally:
        torch.set_num_threads(threads)


_TIMERS: dict[str, Any] = {"torch": _torch_times, "tensorflow": _tensorflow_times, "jax": _jax_times,
                           **{f"keras/{b}": functools.partial(_keras_times, b) for b in ("tensorflow", "jax", "torch")}}


def matmul_slowdown(n: int = 256, repeats: int = 3, framework: str = "torch",
                    control: bool = False) -> dict[str, float]:
    """``{dtype: time of an n x n matmul / float32's}`` for float16 and bfloat16 in ``framework`` (one of
    :data:`FRAMEWORKS`), each the least of ``repeats`` calls taken in turn with the others' (torch: one
    thread; TensorFlow: one thread when no op ran yet in this process; JAX: what ``XLA_FLAGS`` says).
    ``control`` adds :data:`CONTROL`, a second float32 timing / the first (the noise), and the ratios are
    then to the lesser of the two.  Empty when the framework is not installed."""
    if framework not in _TIMERS:
        raise ValueError(f"framework={framework!r} must be one of {', '.join(FRAMEWORKS)}")
    try:  # the control: float32 again, alternating with the others (what the same work reads twice)
        f32, f16, bf16, *again = _TIMERS[framework](n, repeats, ("float32", "float16", "bfloat16")
                                                    + (("float32",) if control else ()))
    except ImportError:  # pragma: no cover
        return {}
    base = min([f32, *again])
    return {"float16": f16 / base, "bfloat16": bf16 / base, **({CONTROL: again[0] / f32} if control else {})}


def matmul_probe(progress: object = None) -> dict[str, float]:
    """:func:`matmul_slowdown` with the signature :func:`~mp_callbacks.app.measurement.run_isolated` calls."""
    return matmul_slowdown()
