"""What to try when training overflows or diverges: the one checklist every error message quotes; and the
float16-on-CPU notice (:func:`cpu_float16_notice`) the adapters report at setup.

The advice depends on what was seen, its *cause*:

* ``"loss"``: a non-finite loss, a forward problem (an activation left the compute dtype's range, bad
  data); the module that produced the first non-finite output comes first, then the dtype, the data,
  the learning rate;
* ``"overflow"``: gradients overflow at a finite loss with the loss scale already below 1: the
  gradients themselves leave float16's range, so the learning rate and clipping come first;
* ``"floor"``: gradients keep overflowing with the loss scale at its floor.

When the culprit module is known (overflow attribution named it) the advice names it and says how to
move it to FP32; when it is not, the advice says how to turn attribution on.  The float16 -> bfloat16
item is left out when the run already computes in another dtype.

>>> checklist("overflow", compute="bfloat16").split(", ")[:2]
['lower the learning rate (or warm it up)', 'clip gradients']
>>> checklist("loss", compute="float16", module="ffn.down").startswith("keep 'ffn.down' in FP32")
True
"""

from __future__ import annotations

from collections.abc import Collection

CAUSES = ("loss", "overflow", "floor")

ITEMS: dict[str, str] = {
    "module": "keep {module!r} in FP32 (policy=PrecisionPolicy.with_fp32_modules({module!r}); while training "
              "in Lightning: plugin.keep_in_fp32({module!r}))",
    "bf16": "switch float16 to bfloat16 (wider range)",
    "inputs": "check the inputs and labels for inf/NaN",
    "lr": "lower the learning rate (or warm it up)",
    "clip": "clip gradients",
    "fp32_ops": "keep more ops in FP32 (norms, softmax, losses, custom ops: PrecisionPolicy.with_fp32_modules)",
    "data": "check the data for extreme values",
    "attribution": "turn on overflow attribution (MixedPrecisionMonitor(attribute_overflows=True)) to name the "
                   "first non-finite module",
}
"""The advice items by key (``{module}``: the culprit's dotted path)."""

ORDER: dict[str, tuple[str, ...]] = {
    "loss": ("module", "bf16", "inputs", "lr", "fp32_ops", "attribution"),
    "overflow": ("lr", "clip", "module", "bf16", "fp32_ops", "attribution"),
    "floor": ("module", "data", "lr", "bf16", "fp32_ops", "attribution"),
}
"""The items each cause lists, most likely fix first (``module`` only with a known culprit, ``attribution``
only without one)."""


def checklist(cause: str, compute: str | None = None, module: str | None = None) -> str:
    """The advice for ``cause`` (one of :data:`CAUSES`), joined with commas, most likely fix first.

    Args:
      cause: what was seen: ``"loss"``, ``"overflow"`` or ``"floor"``.
      compute: the run's compute dtype, if known (no float16 -> bfloat16 item for another dtype).
      module: the module (or layer) that produced the first non-finite value, if known.
    """
    if cause not in CAUSES:
        raise ValueError(f"cause={cause!r} must be one of {', '.join(CAUSES)}")
    skip = {"attribution"} if module else {"module"}
    if compute is not None and compute not in ("float16", "fp16", "half"):
        skip.add("bf16")
    return ", ".join(ITEMS[key].format(module=module) for key in ORDER[cause] if key not in skip)


FLOAT16_CPU_FEATURES = ("amx_fp16", "avx512_fp16")
"""The ``/proc/cpuinfo`` flags that give a CPU native float16 matmul kernels (oneDNN)."""

BFLOAT16_CPU_FEATURES = ("amx_bf16", "avx512_bf16")
"""The flags that give it native bfloat16 matmul kernels (where the notice's bf16-mixed advice holds)."""

FLOAT16_CPU_SLOWDOWNS: dict[str, float] = {"torch": 47, "keras/tensorflow": 1.1, "keras/jax": 1.3,
                                           "keras/torch": 1.3}
"""Float16 matmul time / float32's on a CPU without :data:`FLOAT16_CPU_FEATURES`, per backend: ``"torch"`` (torch's
own matmul: the Lightning adapter) and ``"keras/<backend>"`` (``keras.ops.matmul``, what ``Dense`` calls: the
Keras adapter), as seen on an x86 CPU with AVX2 only.  A backend at or above :data:`FLOAT16_CPU_SLOW` gets
the notice."""

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
