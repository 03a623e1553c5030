"""Keras: our LossScaleOptimizer vs keras.optimizers.LossScaleOptimizer (the scaler's overhead).

    python benchmarks/bench_keras.py [--threads 1 2] [--rounds 7] [--steps 40] [--jit] [--master]

Both variants train the same MLP on the same batches with ``model.fit``
(:func:`mp_callbacks.app.keras_runner.fit_once`), the same AdamW, the same dtype policy and
the same ``jit_compile`` setting; only the loss-scale optimizer differs:

* ``ours``:   ``keras_ext.LossScaleOptimizer(AdamW, "keras")`` (the core transition, evaluated with keras.ops);
* ``native``: ``keras.optimizers.LossScaleOptimizer(AdamW)`` (Keras 3's own).

Both scale dynamically (2**15, growth every 2000 steps); nothing overflows, so
every step does the full work (scale the loss, finite check, unscale, apply,
update the scale state).  The policy is ``mixed_bfloat16`` (the ``bf16-mixed``
recipe's): TensorFlow's float16 kernels on CPU are slow or fused into slow
kernels, which would bury the scaler's cost under matmul time; bf16 keeps the
step fast (AMX) so the scaler's share is as large as it gets.  ``--policy
float32`` runs float32 compute with loss scaling on instead.

``--master``: bf16-master instead (``keras_ext.master_optimizer(AdamW,
"bf16-master")``, bf16 variables, FP32 masters) vs native bf16-mixed (Keras'
``mixed_bfloat16`` policy, FP32 variables, plain AdamW), and bf16-master with
the whole FP32 gradient list widened before the update (the step before each
gradient was widened inside its own variable's update).

Rounds alternate the variants in one process; the ratio is the median over
rounds of ours/native (step time = median of a fit's steps, warm-up excluded).
TensorFlow's thread pools are fixed at its start, so each thread count runs in
its own subprocess of this script.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import base_parser  # noqa: E402

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def worker(args: argparse.Namespace) -> None:
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(args.threads)
    tf.config.threading.set_inter_op_parallelism_threads(args.threads)

    import keras
    from common import alternate, print_table, with_controls

    import keras_ext
    from mp_callbacks.app.compare import RunSpec
    from mp_callbacks.app.keras_runner import fit_once

    recipe = {"mixed_bfloat16": "bf16-mixed", "float32": "32-true"}[args.policy]
    spec = RunSpec(steps=args.steps, batch_size=args.batch_size, hidden=args.hidden, depth=args.depth,
                   threads=args.threads)
    variants = {
        "ours LossScaleOptimizer": lambda inner: keras_ext.LossScaleOptimizer(inner, "keras"),
        "native LossScaleOptimizer": lambda inner: keras.optimizers.LossScaleOptimizer(inner),
    }

    def measure(wrap):
        def once() -> float:
            _, opt, recorder = fit_once(recipe, spec, optimizer=wrap, jit_compile=args.jit, record=False)
            assert isinstance(opt, keras.optimizers.LossScaleOptimizer)
            return statistics.median(recorder.timed())
        return once

    if args.master:
        return masters(args, spec)
    from common import machine_line

    print(machine_line(args.threads))
    times = alternate(with_controls({k: measure(v) for k, v in variants.items()}, ["native LossScaleOptimizer"]),
                      args.rounds)
    print_table(
        f"Keras {keras.__version__} ({keras.backend.backend()}), policy {args.policy}, jit_compile={args.jit}, "
        f"MLP {args.depth}x{args.hidden}, batch {args.batch_size}, {args.threads} thread(s)", times,
        [("ours LossScaleOptimizer", "native LossScaleOptimizer", "<= 1.05")],
    )


def masters(args: argparse.Namespace, spec) -> None:  # noqa: ANN001
    """``--master``: bf16-master (and with the FP32 gradient list) vs native ``mixed_bfloat16`` + AdamW."""
    import keras
    from common import alternate, machine_line, print_table, with_controls

    import keras_ext
    from mp_callbacks.app.keras_runner import _arrays, _Recorder, fit_once, graph_options, mlp

    def ours(fp32_list: bool):
        def wrap(inner):  # noqa: ANN001, ANN202
            opt = keras_ext.master_optimizer(inner, "bf16-master")
            if fp32_list:
                opt._masters.widens_in_update = lambda optimizer: False
            return opt

        def once() -> float:
            return statistics.median(fit_once("bf16-master", spec, optimizer=wrap, record=False)[2].timed())
        return once

    def native() -> float:
        before = keras.config.dtype_policy()
        keras.utils.set_random_seed(spec.seed)
        keras.config.set_dtype_policy("mixed_bfloat16")
        try:
            model = mlp(spec.hidden, spec.depth)
        finally:
            keras.config.set_dtype_policy(before)
        model.compile(keras.optimizers.AdamW(spec.lr), keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      jit_compile=False)
        recorder = _Recorder(None, None, False)
        x, y, w = _arrays(spec)
        with graph_options():
            model.fit(x, y, sample_weight=w, batch_size=spec.batch_size, shuffle=False, verbose=0, callbacks=[recorder])
        return statistics.median(recorder.timed())

    variants = {"ours bf16-master": ours(False), "ours bf16-master, FP32 gradient list": ours(True),
                "native bf16-mixed": native}
    print(machine_line(args.threads))
    times = alternate(with_controls(variants, ["native bf16-mixed"]), args.rounds)
    print_table(f"Keras {keras.__version__} ({keras.backend.backend()}), MLP {args.depth}x{args.hidden}, batch "
                f"{args.batch_size}, {args.threads} thread(s), AdamW, jit_compile=False", times,
                [("ours bf16-master", "native bf16-mixed", "<= 0.95"),
                 ("ours bf16-master", "ours bf16-master, FP32 gradient list", "none")])


def main() -> None:
    parser = base_parser(__doc__)
    parser.add_argument("--policy", choices=["mixed_bfloat16", "float32"], default="mixed_bfloat16")
    parser.add_argument("--jit", action="store_true", help="jit_compile=True (XLA) for both variants")
    parser.add_argument("--master", action="store_true", help="bf16-master vs native bf16-mixed (see above)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        args.threads = args.threads[0]
        worker(args)
        return
    passthrough = ["--rounds", str(args.rounds), "--steps", str(args.steps), "--hidden", str(args.hidden),
                   "--depth", str(args.depth), "--batch-size", str(args.batch_size), "--policy", args.policy]
    passthrough += ["--jit"] * args.jit + ["--master"] * args.master
    env = dict(os.environ, KERAS_BACKEND=os.environ.get("KERAS_BACKEND", "tensorflow"))
    for threads in args.threads:
        env["OMP_NUM_THREADS"] = str(threads)
        proc = subprocess.run([sys.executable, __file__, "--worker", "--threads", str(threads), *passthrough],
                              env=env, cwd=str(ROOT), capture_output=True, text=True)
        print(proc.stdout, end="", flush=True)
        if proc.returncode:
            sys.stderr.write(proc.stderr[-4000:])
            sys.exit(proc.returncode)


if __name__ == "__main__":
    main()
