"""Keras: cost of keras_ext.MixedPrecisionMonitor (log_every_n_steps=50) on a training step.

    python benchmarks/bench_keras_monitor.py [--threads 1 2] [--rounds 7] [--steps 200]

The same MLP (``depth x Dense(hidden, relu) -> Dense(10)``, float32 policy,
``keras_ext.LossScaleOptimizer(Adam)``) and the same batches are fitted with
the monitor off, on (default: meters on logging steps, per-layer overflow
attribution on every step), and on without attribution, alternating in one
process per thread count (TensorFlow's thread pools are fixed at start, so
each thread count runs in a fresh subprocess).  Each variant keeps its model
and its monitor across rounds (one ``fit`` per round, as a user calling
``fit`` repeatedly).  A round's per-step time is the mean over its steps
after a warm-up (logging steps included: 1 in 50), measured by a batch-end
timer that every variant carries; the tracing at the start of each ``fit``
(the monitor retraces to install its hooks) is outside the timed window.
``--clock cpu`` (default) times the process's CPU time, which other jobs on
a shared machine disturb much less than wall time; ``--clock wall`` gives
elapsed time.  Prints the CPU model, median times and median per-round ratios
(target monitor / off <= 1.05); no thresholds.  ``--json PATH`` writes
``PATH-<n>t.json`` per thread count.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def _child(args: argparse.Namespace) -> None:
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(args.child)
    tf.config.threading.set_inter_op_parallelism_threads(args.child)
    import keras
    import numpy as np
    from common import alternate, control_name, print_table, write_json

    import keras_ext

    rng = np.random.default_rng(0)
    n = args.batch_size * args.steps
    x = rng.standard_normal((n, args.features)).astype("float32")
    y = rng.integers(0, 10, n).astype("int64")
    warm = max(5, args.steps // 10)

    clock = time.process_time if args.clock == "cpu" else time.perf_counter

    class Timer(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            self.t = []

        def on_train_batch_end(self, batch, logs=None):
            self.t.append(clock())

    def build():
        keras.utils.set_random_seed(0)
        layers = [keras.Input((args.features,))]
        layers += [keras.layers.Dense(args.hidden, activation="relu") for _ in range(args.depth)]
        model = keras.Sequential(layers + [keras.layers.Dense(10)])
        model.compile(keras_ext.LossScaleOptimizer(keras.optimizers.Adam(1e-4), "keras"),
                      keras.losses.SparseCategoricalCrossentropy(from_logits=True), jit_compile=False)
        return model

    def variant(monitor):
        model = build()
        timer = Timer()

        def once() -> float:
            callbacks = [timer] if monitor is None else [monitor, timer]
            model.fit(x, y, batch_size=args.batch_size, epochs=1, shuffle=False, verbose=0, callbacks=callbacks)
            t = timer.t
            return (t[-1] - t[warm]) / (len(t) - 1 - warm)

        once()  # trace and warm up
        return once

    variants = {
        "monitor off": variant(None),
        control_name("monitor off"): variant(None),
        "monitor on (50)": variant(keras_ext.MixedPrecisionMonitor(log_every_n_steps=50, log_memory=False)),
        "monitor on (50) + attribution": variant(
            keras_ext.MixedPrecisionMonitor(log_every_n_steps=50, log_memory=False, attribute_overflows=True)),
    }
    times = alternate(variants, args.rounds)
    data = print_table(f"Keras {keras.__version__} ({keras.backend.backend()}), MLP {args.depth}x{args.hidden}, "
                f"batch {args.batch_size}, {args.steps} steps/round, {args.child} thread(s), {args.clock} time", times,
                [("monitor on (50)", "monitor off", "<= 1.05"),
                 ("monitor on (50) + attribution", "monitor off", "opt-in, no target")])
    write_json(args.json, data)


def main() -> None:
    from common import base_parser, machine_line

    parser = base_parser(__doc__, rounds=7, steps=200, hidden=512, depth=3, batch_size=256)
    parser.add_argument("--features", type=int, default=256)
    parser.add_argument("--clock", choices=["cpu", "wall"], default="cpu",
                        help="cpu: process CPU time per step (robust to other load on the machine); wall: elapsed")
    parser.add_argument("--child", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args)
        return
    for threads in args.threads:
        print(machine_line(threads), flush=True)
        cmd = [sys.executable, __file__, "--child", str(threads), "--rounds", str(args.rounds), "--steps",
               str(args.steps), "--hidden", str(args.hidden), "--depth", str(args.depth), "--features",
               str(args.features), "--batch-size", str(args.batch_size), "--clock", args.clock]
        if args.json:  # one file per thread count (each runs in its own process): PATH-<n>t.json
            path = Path(args.json)
            cmd += ["--json", str(path.with_name(f"{path.stem}-{threads}t{path.suffix or '.json'}"))]
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), TF_CPP_MIN_LOG_LEVEL="2")
        subprocess.run(cmd, check=True, env=env)


if __name__ == "__main__":
    main()
