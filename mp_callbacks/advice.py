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

FLOAT16_CPU_SLOWDOWN = 47
"""torch's float16 matmul time / float32's, measured on a CPU without them (an AMD EPYC with AVX2 and F16C:
``benchmarks/bench_cpu_float16.py``, 512x512, one thread, the least of three; bfloat16 there: 29x)."""


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


def cpu_float16_notice(recipe: str, compute: str, device_type: str, flags: Collection[str]) -> str | None:
    """The warning for a float16 recipe computing on a CPU without native float16 matmuls, else None
    (another dtype, another device, or CPU flags unknown: ``flags`` empty)."""
    if compute != "float16" or device_type != "cpu" or not flags or any(f in flags for f in FLOAT16_CPU_FEATURES):
        return None
    return (f"{recipe} computes in float16 on a CPU without native float16 matmul kernels (no AMX-FP16 or "
            f"AVX512-FP16 in /proc/cpuinfo): torch falls back to a slow path, ~{FLOAT16_CPU_SLOWDOWN}x float32's "
            "matmul time (measured on an AMD EPYC with AVX2, benchmarks/bench_cpu_float16.py). Use bf16-mixed on "
            "CPU, or train float16 on a GPU.")
