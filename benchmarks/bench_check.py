"""The inf/NaN check of an unscaled step, timed where it runs: right after a real backward.

Hugging Face's ``GPT2LMHeadModel`` from a config (random init), bf16 autocast forward, FP32 parameters, AdamW:
each step runs forward and backward, then :func:`lightning_ext.grad_check.host_check` (the check the plugin runs
with scaling off on the CPU), then the optimizer step.  The check's way rotates step by step: the one native call
over the groups (:mod:`lightning_ext.check_native`), the Python path (gradients listed, validated and handed to
the C scan one by one: :func:`lightning_ext.grad_check.any_nonfinite`), and the native call again as the control,
so every way meets the same cold caches after the backward.  Printed: the median check time of each way per
window of steps, and the per-window ratios (min-max) Python / native and control / native; both ways must
decide alike (asserted every step).

    python benchmarks/bench_check.py --layers 2 --d-model 128     # the transformer benchmark's model
    python benchmarks/bench_check.py --layers 12 --d-model 64     # deeper: more, smaller gradients
    python benchmarks/bench_check.py --serial-vs-kernel --threads 2  # the basis of check_native.SERIAL_VALUES

``--serial-vs-kernel``: synthetic FP32 gradient sets (0.5 M to 32 M values in 6 to 400 tensors), each pass after
a 32 MiB write (the gradients out of the caches, as after a backward), the native call (serial, no value limit)
and torch's check kernel (``_amp_foreach_non_finite_check_and_unscale_`` with a unit scale and the flag's host
read, what the check runs where the native call declines) at ``--threads`` intra-op threads, alternating with a
native control; the median per way and the ratios kernel / native per window (min-max).
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from bench_transformer_model import GPTConfig, hf_gpt2, lm_loss, token_batches  # noqa: E402
from common import base_parser, machine_line, pin_cpus  # noqa: E402

from lightning_ext import check_native  # noqa: E402
from lightning_ext.grad_check import host_check  # noqa: E402

WAYS = ["native call", "Python path", "native call (control)"]


SETS = [(532_000, 29), (2_100_000, 6), (2_100_000, 60), (8_000_000, 50), (8_000_000, 200), (32_000_000, 100),
        (32_000_000, 400)]  # (values, tensors)


def serial_vs_kernel(threads: int, rounds: int, repeats: int) -> None:
    """The native call against torch's kernel on :data:`SETS` at ``threads`` threads (module docstring)."""
    torch.set_num_threads(1)
    native = check_native.native_check()
    if native is None:
        raise SystemExit("the native check is not available here (see its warning)")
    torch.set_num_threads(threads)
    print(machine_line(threads))
    flush, unit, found = torch.randn(8 << 20), torch.ones(()), torch.zeros(())
    for values, count in SETS:
        params = [torch.nn.Parameter(torch.zeros(values // count)) for _ in range(count)]
        for p in params:
            p.grad = torch.randn(p.numel())
        groups, grads = [{"params": params}], [p.grad for p in params]
        ways = {"native call": lambda g=groups: native._groups(g, -1),
                "torch's kernel": lambda g=grads: (torch._amp_foreach_non_finite_check_and_unscale_(g, found, unit),
                                                   found.item()),
                "native call (control)": lambda g=groups: native._groups(g, -1)}
        medians: dict[str, list[float]] = {w: [] for w in ways}
        for _ in range(rounds):
            times: dict[str, list[float]] = {w: [] for w in ways}
            for _ in range(repeats):
                for way, run in ways.items():
                    flush.add_(1.0)
                    t0 = time.perf_counter()
                    run()
                    times[way].append(time.perf_counter() - t0)
            for way in ways:
                medians[way].append(statistics.median(times[way]))
        kernel = [a / b for a, b in zip(medians["torch's kernel"], medians["native call"])]
        control = [a / b for a, b in zip(medians["native call (control)"], medians["native call"])]
        ours_us = 1e6 * statistics.median(medians["native call"])
        kernel_us = 1e6 * statistics.median(medians["torch's kernel"])
        print(f"  {values:>10} values in {count:>3} tensors: native {ours_us:8.1f} us, kernel {kernel_us:8.1f} us; "
              f"ratio kernel / native {statistics.median(kernel):.3f} ({min(kernel):.3f}-{max(kernel):.3f}), "
              f"control {statistics.median(control):.3f}")


def main() -> None:
    parser = base_parser(__doc__, rounds=8, steps=600, batch_size=4)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--serial-vs-kernel", action="store_true", help="the native call vs torch's kernel")
    args = parser.parse_args()
    if args.serial_vs_kernel:
        serial_vs_kernel(args.threads[0], min(args.rounds, 5), 12)
        return
    torch.set_num_threads(1)
    print(machine_line(1) + ("" if args.no_pin else pin_cpus(1)))
    if check_native.native_check() is None:
        raise SystemExit("the native check is not available here (see its warning)")
    cfg = GPTConfig(vocab=512, seq=args.seq, d_model=args.d_model, heads=4, layers=args.layers, ff=4 * args.d_model)
    torch.manual_seed(0)
    model = hf_gpt2(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batches = token_batches(cfg, args.steps, args.batch_size)
    times: dict[str, list[float]] = {w: [] for w in WAYS}
    cpu = torch.device("cpu")
    for step, (x, y) in enumerate(batches):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = lm_loss(model(x).logits, y)
        loss.backward()
        way = WAYS[step % len(WAYS)]
        check_native.NATIVE = way != "Python path"
        t0 = time.perf_counter()
        found = host_check(opt, cpu, True)
        times[way].append(time.perf_counter() - t0)
        check_native.NATIVE = True
        assert found is False, f"step {step}: the check found a non-finite gradient (or declined: {found})"
        opt.step()
        opt.zero_grad(set_to_none=True)
    n_tensors = sum(1 for _ in model.parameters())
    warm = len(times[WAYS[0]]) // 10
    window = (len(times[WAYS[0]]) - warm) // args.rounds
    medians = {w: [statistics.median(ts[warm + i * window: warm + (i + 1) * window]) for i in range(args.rounds)]
               for w, ts in times.items()}
    print(f"HF GPT2LMHeadModel ({args.layers} layers, d_model {args.d_model}, {n_tensors} parameter tensors, "
          f"{sum(p.numel() for p in model.parameters())} params), batch {args.batch_size} x seq {args.seq}, "
          f"bf16 autocast, {args.steps} steps, the way rotating per step, {args.rounds} windows")
    for w in WAYS:
        print(f"  {w:<24} check median {1e6 * statistics.median(medians[w]):8.1f} us "
              f"(windows {1e6 * min(medians[w]):.1f}-{1e6 * max(medians[w]):.1f})")
    for w in WAYS[1:]:
        rs = [a / b for a, b in zip(medians[w], medians[WAYS[0]])]
        print(f"  ratio {w} / native call: {statistics.median(rs):.3f} ({min(rs):.3f}-{max(rs):.3f})")


if __name__ == "__main__":
    main()
