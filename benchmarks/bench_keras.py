"""Keras: our LossScaleOptimizer vs keras.optimizers.LossScaleOptimizer (the scaler's overhead).

    python benchmarks/bench_keras.py [--threads 1 2] [--rounds 7] [--steps 40] [--jit]

Both variants train the same MLP on the same batches with ``model.fit``
(:func:`keras_ext.compare.fit_once`), the same AdamW, the same dtype policy and
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

    import keras_ext
    from common import alternate, print_table, with_controls
    from keras_ext.compare import fit_once
    from mp_callbacks.compare import RunSpec

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

    times = alternate(with_controls({k: measure(v) for k, v in variants.items()}, ["native LossScaleOptimizer"]),
                      args.rounds)
    print_table(
        f"Keras {keras.__version__} ({keras.backend.backend()}), policy {args.policy}, jit_compile={args.jit}, "
        f"MLP {args.depth}x{args.hidden}, batch {args.batch_size}, {args.threads} thread(s)", times,
        [("ours LossScaleOptimizer", "native LossScaleOptimizer", "<= 1.05")],
    )


def main() -> None:
    parser = base_parser(__doc__)
    parser.add_argument("--policy", choices=["mixed_bfloat16", "float32"], default="mixed_bfloat16")
    parser.add_argument("--jit", action="store_true", help="jit_compile=True (XLA) for both variants")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        args.threads = args.threads[0]
        worker(args)
        return
    passthrough = ["--rounds", str(args.rounds), "--steps", str(args.steps), "--hidden", str(args.hidden),
                   "--depth", str(args.depth), "--batch-size", str(args.batch_size), "--policy", args.policy]
    if args.jit:
        passthrough.append("--jit")
    env = dict(os.environ, KERAS_BACKEND=os.environ.get("KERAS_BACKEND", "tensorflow"))
    for threads in args.threads:
        env["OMP_NUM_THREADS"] = str(threads)
        proc = subprocess.run([sys.executable, __file__, "--worker", "--threads", str(threads), *passthrough],
                              env=env, cwd=str(ROOT), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        print(proc.stdout, end="", flush=True)
        if proc.returncode:
            sys.stderr.write(proc.stderr[-4000:])
            sys.exit(proc.returncode)


if __name__ == "__main__":
    main()
