"""How much slower torch's float16 (and bfloat16) matmul is than float32 on this CPU, one thread.

The figure behind the Lightning adapter's float16-on-CPU warning (:func:`mp_callbacks.advice.cpu_float16_notice`):
CPUs without AMX-FP16 / AVX512-FP16 have no native float16 matmul kernel, and torch's fallback is tens of
times slower than float32.  Run: ``python benchmarks/cpu_float16_matmul.py [N]``.
"""

from __future__ import annotations

import sys

from mp_callbacks.advice import cpu_flags
from mp_callbacks.app.machine import cpu_model, features, matmul_slowdown


def main(n: int = 512) -> None:
    found = features(cpu_flags())
    print(f"CPU: {cpu_model()}; " + ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in found.items()))
    best: dict[str, float] = {}
    for _ in range(3):  # the least of three: other jobs on the machine only ever slow a run down
        for dtype, ratio in matmul_slowdown(n, repeats=5).items():
            best[dtype] = min(ratio, best.get(dtype, ratio))
    print(f"{n}x{n} matmul, 1 thread, time / float32's: " + ", ".join(f"{k} {v:.1f}x" for k, v in best.items()))


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:2]))
