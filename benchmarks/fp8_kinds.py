"""Which FP8 kind (tensorwise, rowwise, blockwise, MXFP8) keeps what, carries how many scale bytes, trains how?

    python benchmarks/fp8_kinds.py [--parts snr bytes train] [--ratios 1e2 1e3 1e4 1e5] [--shape 16384 4096 4096]
        [--rounds 5] [--steps 20] [--warmup 3] [--hidden 256] [--depth 2] [--batch-size 64] [--threads 1]
        [--json PATH]

* ``snr``: the quantization error on outliers.  Two stress cases of ``mp_callbacks.fp8.outlier_operands``
  (64 x 256 activations, 128 x 256 weights): ``channels`` (3 input features ``ratio`` times the rest, their weights
  ``1/ratio``: LLM-like outlier features) and ``tokens`` (2 rows ``ratio`` times the rest).  Per ratio and kind:
  the median per-row SNR of ``fp8(x) @ fp8(w).T`` against FP32 (dB, higher is better), e4m3, with the core's casts
  (``mp_callbacks.fp8.matmul_snr_db``, the NumPy reference the adapters are tested against) and with torchao's
  (``hp_tensor_to_float8_dynamic`` for tensorwise and rowwise, ``to_mx`` for MXFP8 floor/rceil; torchao has no
  CPU blockwise cast: ``-``).  Exact, machine-independent figures.
* ``bytes``: the scale bytes one FP8 copy of each operand of a ``(tokens x in) @ (out x in).T`` matmul carries
  per kind (``mp_callbacks.fp8.scale_bytes``), and their share of the FP8 payload.
* ``train``: ``fp8-mixed`` at each kind (``FabricMixedPrecision("fp8-mixed", fp8={"granularity": kind})``; the
  default ``fp8-mixed`` is tensorwise with delayed scaling) against ours and native ``bf16-mixed``, an MLP on
  scikit-learn's digits with AdamW in a Fabric loop: step time (``harness.py``, native ``bf16-mixed`` with its
  control) and the mean loss of the last 10 steps.  On a CPU every FP8 matmul is emulated (casts, then a float32
  matmul): the times show the emulation's cost, not FP8 hardware's speed.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness  # noqa: E402
import numpy as np  # noqa: E402

from mp_callbacks.fp8 import matmul_snr_db, outlier_operands, scale_bytes  # noqa: E402

KINDS = (("tensorwise", {}), ("rowwise", {}), ("blockwise", {}), ("mxfp8", {"mx_rounding": "floor"}),
         ("mxfp8", {"mx_rounding": "rceil"}))


def _label(kind: str, settings: dict) -> str:
    return f"{kind}-{settings['mx_rounding']}" if settings else kind


def torchao_snr(x: np.ndarray, w: np.ndarray, kind: str, settings: dict) -> float | None:
    """:func:`matmul_snr_db` with torchao's casts (None where torchao has no CPU cast of ``kind``)."""
    import torch

    try:
        from torchao.float8.config import ScalingGranularity
        from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
        from torchao.float8.float8_training_tensor import LinearMMConfig
        from torchao.prototype.mx_formats.config import ScaleCalculationMode
        from torchao.prototype.mx_formats.mx_tensor import to_mx
    except ImportError:
        return None

    def cast(a: np.ndarray) -> np.ndarray:
        t = torch.from_numpy(a).contiguous()
        if kind in ("tensorwise", "rowwise"):
            rowwise = kind == "rowwise"
            f = hp_tensor_to_float8_dynamic(
                t, torch.float8_e4m3fn, LinearMMConfig(),
                scaling_granularity=ScalingGranularity.AXISWISE if rowwise else ScalingGranularity.TENSORWISE,
                axiswise_dim=-1 if rowwise else None, round_scales_to_power_of_2=rowwise)
            return (f._data.float() / f._scale).numpy()
        mode = ScaleCalculationMode.RCEIL if settings.get("mx_rounding") == "rceil" else ScaleCalculationMode.FLOOR
        exp, data = to_mx(t, torch.float8_e4m3fn, 32, mode)
        scale = torch.exp2(exp.view(torch.uint8).float() - 127).repeat_interleave(32, dim=-1)
        return (data.float() * scale).numpy()

    if kind == "blockwise":
        return None
    ref = x.astype(np.float64) @ w.T.astype(np.float64)
    err = cast(x).astype(np.float64) @ cast(w).T.astype(np.float64) - ref
    with np.errstate(divide="ignore"):
        return float(10 * np.log10(np.median((ref**2).sum(1) / (err**2).sum(1))))


def snr_part(ratios: list[float]) -> tuple[list[dict], str]:
    rows, names = [], [_label(k, s) for k, s in KINDS]
    lines = [f"| case | ratio | {' | '.join(names)} |", "|---|---|" + "---|" * len(names)]
    for case in ("channels", "tokens"):
        for ratio in ratios:
            x, w = outlier_operands(case, ratio)
            cells = []
            for kind, settings in KINDS:
                ours, theirs = matmul_snr_db(x, w, kind, **settings), torchao_snr(x, w, kind, settings)
                rows.append({"case": case, "ratio": ratio, "kind": _label(kind, settings), "ours_db": ours,
                             "torchao_db": theirs})
                cells.append(f"{ours:.1f} / {'-' if theirs is None else f'{theirs:.1f}'}")
            lines.append(f"| {case} | {ratio:g} | {' | '.join(cells)} |")
    return rows, "SNR of fp8(x) @ fp8(w).T against FP32, e4m3, dB (ours / torchao's casts):\n\n" + "\n".join(lines)


def bytes_part(tokens: int, d_in: int, d_out: int) -> tuple[list[dict], str]:
    rows = []
    lines = ["| kind | activation scales (B) | weight scales (B) | share of the FP8 payload |", "|---|---|---|---|"]
    for kind in ("tensorwise", "rowwise", "blockwise", "mxfp8"):
        a, b = scale_bytes((tokens, d_in), kind), scale_bytes((d_out, d_in), kind, weight=True)
        share = (a + b) / (tokens * d_in + d_out * d_in)
        rows.append({"kind": kind, "activation_scale_bytes": a, "weight_scale_bytes": b, "share": share})
        lines.append(f"| {kind} | {a:,} | {b:,} | {100 * share:.3f} % |")
    return rows, (f"Scale bytes of one FP8 copy of the operands of ({tokens} x {d_in}) @ ({d_out} x {d_in}).T:\n\n"
                  + "\n".join(lines))


def train_part(args: Any) -> tuple[dict, str]:
    import torch
    import torch.nn.functional as F
    import torch_models as tm
    from harness import Variant
    from lightning_variants import fabric_build

    batches, _ = tm.digits(64, args.batch_size)
    losses: dict[str, list] = {}

    def recorded(name: str, v: Variant, options: dict | None) -> harness.Build:
        """``name``'s build, its losses kept in ``losses[name]`` (the last built of a name: the control)."""
        def build(clock: harness.Clock) -> Any:
            kept = losses[name] = []

            def loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
                value = F.cross_entropy(out.float(), y)
                kept.append(value.detach())
                return value
            return fabric_build(v, lambda: tm.mlp(args.hidden, args.depth), batches, loss, options=options)(clock)
        return build

    runs = {"native bf16-mixed": (Variant("native", "bf16-mixed"), None),
            "ours bf16-mixed": (Variant("ours", "bf16-mixed"), None),
            "ours fp8-mixed (default: tensorwise, delayed)": (Variant("ours", "fp8-mixed"), None)}
    for kind in ("tensorwise", "rowwise", "blockwise", "mxfp8"):
        runs[f"ours fp8-mixed, {kind}"] = (Variant("ours", "fp8-mixed"), {"fp8": {"granularity": kind}})
    builds = {name: recorded(name, v, options) for name, (v, options) in runs.items()}
    times = harness.run_rounds(harness.with_controls(builds, ["native bf16-mixed"]), args.rounds, args.steps,
                               args.warmup)
    pairs = [(name, "native bf16-mixed") for name in runs if name != "native bf16-mixed"]
    summary = harness.summarize(times, pairs)
    final = {name: float(torch.stack(v[-10:]).mean()) for name, v in losses.items()}
    text = harness.markdown(f"Fabric, MLP 64-{'-'.join([str(args.hidden)] * args.depth)}-10 on digits, batch "
                            f"{args.batch_size}, AdamW; {args.rounds} rounds x {args.steps} steps", summary)
    text += "\n| variant | mean loss of its last 10 steps |\n|---|---|\n" + "\n".join(
        f"| {k} | {v:.5f} |" for k, v in final.items())
    return {"timing": summary, "final_loss": final}, text


def main(argv: list[str] | None = None) -> dict:
    p = harness.parser(__doc__, rounds=5, steps=20, warmup=3)
    p.add_argument("--parts", nargs="+", choices=["snr", "bytes", "train"], default=["snr", "bytes", "train"])
    p.add_argument("--ratios", type=float, nargs="+", default=[1e2, 1e3, 1e4, 1e5])
    p.add_argument("--shape", type=int, nargs=3, default=[16384, 4096, 4096], metavar=("TOKENS", "IN", "OUT"))
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--depth", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=64)
    args = p.parse_args(argv)
    harness.quiet()
    harness.setup(args)
    out: dict[str, Any] = {}
    texts = []
    if "snr" in args.parts:
        out["snr"], text = snr_part(args.ratios)
        texts.append(text)
    if "bytes" in args.parts:
        out["bytes"], text = bytes_part(*args.shape)
        texts.append(text)
    if "train" in args.parts:
        out["train"], text = train_part(args)
        texts.append(text)
    print(harness.machine_line(args.threads))
    print("\n\n".join(texts))
    harness.write_json(args.json, out, args.threads)
    return out


if __name__ == "__main__":
    main()
