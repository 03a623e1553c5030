"""FP8 scaling granularity on outliers: how much of ``x @ w.T`` each granularity keeps (NumPy reference casts).

    python benchmarks/bench_fp8_granularity.py [--ratios 1e2 1e3 1e4 1e5] [--format float8_e4m3fn]

Two stress cases of :func:`mp_callbacks.fp8.granularity.outlier_operands` (64 x 256 activations, 128 x 256
weights): ``channels`` (3 input features ``ratio`` times the rest, their weights ``1/ratio``: LLM-like
outlier features) and ``tokens`` (2 rows ``ratio`` times the rest).  For each ratio and granularity it
prints the median per-row SNR of the FP8 matmul against FP32 (dB, higher is better;
:func:`~mp_callbacks.fp8.granularity.matmul_snr_db`) and the error-power factor against tensorwise.
Not a timing: the figures are exact and machine-independent (the CPU line is printed all the same).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import machine_line  # noqa: E402

from mp_callbacks.fp8 import matmul_snr_db, outlier_operands  # noqa: E402

KINDS = (("tensorwise", {}), ("rowwise", {}), ("blockwise", {}), ("mxfp8", {"mx_rounding": "floor"}),
         ("mxfp8", {"mx_rounding": "rceil"}))


def table(ratios: list[float], fmt: str) -> list[str]:
    names = [k if not s else f"{k}-{s['mx_rounding']}" for k, s in KINDS]
    lines = [f"| case | ratio | {' | '.join(names)} |", "|---|---|" + "---|" * len(names)]
    for case in ("channels", "tokens"):
        for ratio in ratios:
            x, w = outlier_operands(case, ratio)
            snr = [matmul_snr_db(x, w, k, fmt, **s) for k, s in KINDS]
            cells = [f"{v:.1f} dB" + ("" if i == 0 else f" ({10 ** ((v - snr[0]) / 10):.3g}x)")
                     for i, v in enumerate(snr)]
            lines.append(f"| {case} | {ratio:g} | {' | '.join(cells)} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ratios", type=float, nargs="+", default=[1e2, 1e3, 1e4, 1e5])
    parser.add_argument("--format", default="float8_e4m3fn")
    args = parser.parse_args()
    print(machine_line())
    print(f"FP8 {args.format}: median per-row SNR of fp8(x) @ fp8(w).T vs FP32 (x error-power reduction vs "
          "tensorwise in brackets)\n")
    print("\n".join(table(args.ratios, args.format)))


if __name__ == "__main__":
    main()
