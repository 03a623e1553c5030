"""What to try when training overflows or diverges: the one checklist every error message quotes; and the
float16-on-CPU notice (:func:`cpu_float16_notice`) the adapters report at setup.

Each item answers some causes: ``"loss"`` (a non-finite loss: a forward problem),
``"overflow"`` (gradients overflow at a finite loss with the scale already below 1) and
``"floor"`` (gradients keep overflowing with the loss scale at its floor).  The float16 ->
bfloat16 item is left out when the run already computes in another dtype.

>>> checklist("overflow", compute="bfloat16").split(", ")[:2]
['lower the learning rate (or warm it up)', 'clip gradients']
"""

from __future__ import annotations

from collections.abc import Collection

CAUSES = ("loss", "overflow", "floor")

CHECKLIST: tuple[tuple[str, frozenset[str]], ...] = (
    ("check the inputs and labels for inf/NaN", frozenset({"loss"})),
    ("lower the learning rate (or warm it up)", frozenset(CAUSES)),
    ("clip gradients", frozenset({"overflow"})),
    ("keep more ops in FP32 (norms, softmax, losses, custom ops: PrecisionPolicy.with_fp32_modules)",
     frozenset(CAUSES)),
    ("switch float16 to bfloat16 (wider range)", frozenset(CAUSES)),
    ("check the data for extreme values", frozenset({"floor"})),
    ("turn on overflow attribution (MixedPrecisionMonitor(attribute_overflows=True)) to name the first "
     "non-finite module", frozenset({"loss", "floor"})),
)
"""``(advice, causes it answers)``, in the order messages list them."""

FLOAT16_ITEM = CHECKLIST[4][0]


def checklist(cause: str, compute: str | None = None) -> str:
    """The advice for ``cause``, joined with commas (``compute``: the run's compute dtype, if known)."""
    if cause not in CAUSES:
        raise ValueError(f"cause={cause!r} must be one of {', '.join(CAUSES)}")
    skip_fp16 = compute is not None and compute not in ("float16", "fp16", "half")
    return ", ".join(text for text, causes in CHECKLIST
                     if cause in causes and not (skip_fp16 and text == FLOAT16_ITEM))


FLOAT16_CPU_FEATURES = ("amx_fp16", "avx512_fp16")
"""The ``/proc/cpuinfo`` flags that give a CPU native float16 matmul kernels (oneDNN)."""

BFLOAT16_CPU_FEATURES = ("amx_bf16", "avx512_bf16")
"""The flags that give it native bfloat16 matmul kernels (where the notice's bf16-mixed advice holds)."""

FLOAT16_CPU_SLOWDOWNS: dict[str, float] = {"torch": 47, "keras/tensorflow": 1.1, "keras/jax": 1.3,
                                           "keras/torch": 1.3}
"""Float16 matmul time / float32's on a CPU without :data:`FLOAT16_CPU_FEATURES`, per backend: ``"torch"`` (torch's
own matmul: the Lightning adapter) and ``"keras/<backend>"`` (``keras.ops.matmul``, what ``Dense`` calls: the
Keras adapter).  A backend at or above :data:`FLOAT16_CPU_SLOW` gets the notice; the figures and how they were
taken are in ``benchmarks/README.md``."""

FLOAT16_CPU_SLOW = 2.0
"""The notice's threshold: a backend whose measured slowdown is below it has nothing to warn about."""


def cpu_flags() -> set[str]:
    """The flags of the first processor in ``/proc/cpuinfo`` (empty when unreadable: not Linux)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:  # pragma: no cover - not Linux
        pass
    return set()


def cpu_float16_notice(recipe: str, compute: str, device_type: str, flags: Collection[str],
                       backend: str = "torch") -> str | None:
    """The warning for a float16 recipe computing on a CPU without native float16 matmuls in ``backend`` (a key
    of :data:`FLOAT16_CPU_SLOWDOWNS`), else None: another dtype, another device, CPU flags unknown (``flags``
    empty), or a backend with no measured slowdown of at least :data:`FLOAT16_CPU_SLOW`."""
    slowdown = FLOAT16_CPU_SLOWDOWNS.get(backend, 0.0)
    if (compute != "float16" or device_type != "cpu" or not flags or slowdown < FLOAT16_CPU_SLOW
            or any(f in flags for f in FLOAT16_CPU_FEATURES)):
        return None
    advice = ("Use bf16-mixed on this CPU (it has native bfloat16 kernels)" if any(
        f in flags for f in BFLOAT16_CPU_FEATURES) else "This CPU has no native bfloat16 kernels either (no "
              "AVX512-BF16 or AMX-BF16), so bf16-mixed may be as slow: use 32-true on it")
    return (f"{recipe} computes in float16 on a CPU without native float16 matmul kernels (no AMX-FP16 or "
            f"AVX512-FP16 in /proc/cpuinfo): {backend} falls back to a slow path, ~{slowdown:g}x float32's matmul "
            "time. "
            f"{advice}, or train float16 on a GPU.")
