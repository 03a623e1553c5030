"""Keras: the cost of restoring the forward's state on skipped steps (``keras_ext.restore_on_skip``).

    python benchmarks/bench_keras_bn_skip.py [--threads 1 2] [--rounds 7] [--steps 40] [--hidden 512] [--depth 3]

A skipped step must not leave BatchNorm's moving statistics poisoned by the inf batch it skipped.  With
``keras_ext.LossScaleOptimizer`` the compiled ``train_step`` therefore copies every non-trainable floating
variable before the step (a copy of what the forward writes: the moving mean and variance, 2 floats per
channel and BatchNormalization) and writes them back in a ``cond`` that runs on skipped steps only.  Both
variants train the same MLP (``depth`` x (Dense(hidden) -> BatchNormalization -> ReLU) -> Dense(10)) under
``bf16-mixed`` with ``keras_ext.master_optimizer(AdamW)``, traced (``jit_compile=False``), on the same
batches with no overflow (every step pays the copy, none the write):

* ``restore on``:  the default after ``model.compile`` (``restore_on_skip(model)``);
* ``restore off``: ``restore_on_skip(model, enabled=False)``.

House method (``common.py``): one process per thread count, the variants alternate round by round (order
reversed every other round), a control runs ``restore off`` a second time; per-round ratios, their median
and min-max; wall and CPU time; the CPU model is printed.
"""

from __future__ import annotations

import argparse
import os
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
    import warnings

    import keras
    import numpy as np
    from common import alternate, machine_line, per_step, print_tables, with_controls

    import keras_ext
    from keras_ext.forward_state import forward_state

    warnings.filterwarnings("ignore")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(args.batch_size, args.hidden)).astype("float32")
    y = rng.integers(0, 10, size=(args.batch_size,))

    def model(restore: bool):
        keras_ext.set_global_policy("bf16-mixed")
        keras.utils.set_random_seed(0)
        layers = [keras.Input((args.hidden,))]
        for _ in range(args.depth):
            layers += [keras.layers.Dense(args.hidden), keras.layers.BatchNormalization(), keras.layers.ReLU()]
        net = keras_ext.apply_policy(keras.Sequential(layers + [keras.layers.Dense(10)]))
        net.compile(keras_ext.master_optimizer(keras.optimizers.AdamW(1e-3), "bf16-mixed"),
                    keras.losses.SparseCategoricalCrossentropy(from_logits=True), jit_compile=False)
        if not restore:
            keras_ext.restore_on_skip(net, enabled=False)
        for _ in range(3):  # trace and warm up
            net.train_on_batch(x, y)
        return net

    nets = {"restore on": model(True), "restore off": model(False)}
    assert "train_step" in nets["restore on"].__dict__ and "train_step" not in nets["restore off"].__dict__
    state = sum(int(np.prod(v.shape)) for v in forward_state(nets["restore on"]))
    params = sum(int(np.prod(v.shape)) for v in nets["restore on"].trainable_variables)
    print(machine_line(args.threads))
    print(f"forward state copied per step: {state} floats ({4 * state} bytes) next to {params} parameters")
    variants = {name: per_step(lambda n=net: n.train_on_batch(x, y), args.steps) for name, net in nets.items()}
    times = alternate(with_controls(variants, ["restore off"]), args.rounds)
    print_tables(f"Keras {keras.__version__} ({keras.backend.backend()}), bf16-mixed, MLP {args.depth}x{args.hidden} "
                 f"+ BatchNorm, batch {args.batch_size}, {args.threads} thread(s), {args.steps} steps per round",
                 times, [("restore on", "restore off", "measured")])


def main() -> None:
    parser = base_parser(__doc__, rounds=7, steps=40, hidden=512, depth=3, batch_size=256)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        args.threads = args.threads[0]
        worker(args)
        return
    passthrough = ["--rounds", str(args.rounds), "--steps", str(args.steps), "--hidden", str(args.hidden),
                   "--depth", str(args.depth), "--batch-size", str(args.batch_size)]
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
