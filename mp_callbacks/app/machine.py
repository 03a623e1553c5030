"""What this machine's CPU offers for low-precision compute, and what that means for each recipe.

Read from ``/proc/cpuinfo`` (Linux; elsewhere nothing is found and the notes say so).  The
figures that matter are measured (``mpx demo``'s matmul probe, ``mpx compare``'s step times);
the features explain them:

* ``amx_bf16`` / ``amx_fp16``: AMX tiles (Sapphire Rapids and later; fp16 from Granite Rapids):
  oneDNN's bf16 / fp16 matmuls run faster than FP32.
* ``avx512_bf16`` / ``avx512_fp16``: bf16 dot products / fp16 arithmetic in AVX-512: oneDNN has
  native kernels for that dtype (about FP32 speed, more for memory-bound work).
* none of them: no native kernel; torch's bf16/fp16 matmul on CPU takes a fallback path that can be
  tens of times slower than FP32 (seen: ~35-90x on an AMD EPYC with AVX2 only).  The recipes still
  give their memory (bytes/param) and their numerics; their speed then describes this CPU only.
"""

from __future__ import annotations

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


def matmul_slowdown(n: int = 256, repeats: int = 3) -> dict[str, float]:
    """``{dtype: time of an n x n matmul / float32's}`` for float16 and bfloat16 with torch (one thread);
    empty when torch is not installed."""
    try:
        import torch
    except ImportError:  # pragma: no cover
        return {}
    import time

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        times = {}
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            a = torch.randn(n, n).to(dtype)
            a @ a  # warm-up
            start = time.perf_counter()
            for _ in range(repeats):
                a @ a
            times[str(dtype).replace("torch.", "")] = (time.perf_counter() - start) / repeats
    finally:
        torch.set_num_threads(threads)
    return {k: v / times["float32"] for k, v in times.items() if k != "float32"}


def matmul_probe(progress: object = None) -> dict[str, float]:
    """:func:`matmul_slowdown` with the signature :func:`~mp_callbacks.app.measurement.run_isolated` calls."""
    return matmul_slowdown()
