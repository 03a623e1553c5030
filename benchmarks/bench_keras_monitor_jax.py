"""Keras on JAX: cost of the divergence rule and of keras_ext.MixedPrecisionMonitor(log_every_n_steps=50).

    python benchmarks/bench_keras_monitor_jax.py [--rounds 7] [--steps 200] [--hidden 512] [--depth 3]

Runs with ``KERAS_BACKEND=jax`` (set before Keras is imported; JAX's default CPU
threads).  The same MLP (``depth x Dense(hidden, relu) -> Dense(10)``, float32
policy, ``keras_ext.LossScaleOptimizer(Adam, "keras")``, ``jit_compile=True``:
the JAX trainer's jitted step) and the same batches are fitted

* with the divergence rule off (``divergence=False``) and no monitor: the baseline;
* with the default rule: on JAX its stop latch is one scalar read of the returned
  state per step (a host sync per step, as on TensorFlow);
* with the default rule and the monitor (log every 50 steps, no memory report):
  its device record rides in the jitted step, and logging steps sync the
  trainer's state into the variables and read it once,

alternating in one process, each variant keeping its model and monitor across
rounds (one ``fit`` per round).  JAX dispatches steps asynchronously, so a
round's time runs from the end of the warm-up step to the end of the last step,
both taken after blocking on that step's loss: steps in flight are counted, and
the per-step reads are nothing extra for the variants without them.  The
monitor's retrace at each ``fit`` start (its train function is compiled again)
falls before the warm-up mark.  Prints the CPU model, median times per step
(process CPU time and wall time) and the median per-round ratios; no thresholds.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

os.environ["KERAS_BACKEND"] = "jax"
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> None:
    from common import alternate, base_parser, by_clock, control_name, machine_line, print_table, write_json

    parser = base_parser(__doc__, rounds=7, steps=200, hidden=512, depth=3, batch_size=256)
    parser.add_argument("--features", type=int, default=256)
    args = parser.parse_args()
    print(machine_line(), flush=True)

    import jax
    import keras
    import numpy as np

    import keras_ext

    rng = np.random.default_rng(0)
    n = args.batch_size * args.steps
    x = rng.standard_normal((n, args.features)).astype("float32")
    y = rng.integers(0, 10, n).astype("int64")
    warm = max(5, args.steps // 10)

    class Timer(keras.callbacks.Callback):
        """(wall, cpu) at the end of the warm-up step and of the last step, each after blocking on the loss."""

        def on_train_begin(self, logs=None):
            self.marks = []

        def on_train_batch_end(self, batch, logs=None):
            if batch in (warm, args.steps - 1):
                jax.block_until_ready(logs)
                self.marks.append((time.perf_counter(), time.process_time()))

    def variant(rule: bool, monitor: bool):
        keras.utils.set_random_seed(0)
        layers = [keras.Input((args.features,))]
        layers += [keras.layers.Dense(args.hidden, activation="relu") for _ in range(args.depth)]
        model = keras.Sequential(layers + [keras.layers.Dense(10)])
        opt = keras_ext.LossScaleOptimizer(keras.optimizers.Adam(1e-4), "keras", divergence=None if rule else False)
        model.compile(opt, keras.losses.SparseCategoricalCrossentropy(from_logits=True), jit_compile=True)
        callbacks = [keras_ext.MixedPrecisionMonitor(log_every_n_steps=50, log_memory=False)] if monitor else []
        timer = Timer()

        def once() -> tuple[float, float]:
            model.fit(x, y, batch_size=args.batch_size, epochs=1, shuffle=False, verbose=0,
                      callbacks=[*callbacks, timer])
            (w0, c0), (w1, c1) = timer.marks
            steps = args.steps - 1 - warm
            return (w1 - w0) / steps, (c1 - c0) / steps

        once()  # compile and warm up
        return once

    variants = {
        "rule off": variant(False, False),
        control_name("rule off"): variant(False, False),
        "rule on (default)": variant(True, False),
        "rule on + monitor (50)": variant(True, True),
    }
    times = by_clock(alternate(variants, args.rounds))
    title = (f"Keras {keras.__version__} (jax {jax.__version__}), MLP {args.depth}x{args.hidden}, batch "
             f"{args.batch_size}, {args.steps} steps/round, jit")
    pairs = [("rule on (default)", "rule off", "measured (one scalar read per step)"),
             ("rule on + monitor (50)", "rule on (default)", "<= 1.05")]
    data = {clock: print_table(f"{title} [{clock} time]", t, pairs) for clock, t in times.items()}
    write_json(args.json, data)


if __name__ == "__main__":
    main()
