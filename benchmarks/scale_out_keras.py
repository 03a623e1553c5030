"""The Keras part of ``scale_out.py``: two ``MultiWorkerMirroredStrategy`` workers on this machine, bytes read from
the traced step's collective ops.

Each worker (``TF_CONFIG`` on localhost, one CPU replica, one thread) builds the ``mpx compare`` MLP in FP32 under the
strategy's scope, applies the recipe (``keras_ext.set_global_policy`` + ``keras_ext.apply_policy``), wraps Keras'
AdamW in ``keras_ext.master_optimizer(AdamW, get_recipe(recipe, comm_dtype=...))`` and trains with the loop
Keras' own TensorFlow ``train_step`` runs (loss, ``optimizer.scale_loss``, the tape's gradients,
``optimizer.apply``) under ``strategy.run`` in one ``tf.function`` (``model.fit`` itself fails under a
multi-worker strategy in Keras 3, keras-team/keras#20585).  Worker i reads half i of each global batch.  The bytes:
every collective op of the traced step's graph (its functions included) and what it is handed (dtype x elements).
Native (Keras' own ``mixed_bfloat16`` and AdamW, no loss scaling) runs the
same loop.  The loop's loss (``strategy.reduce``, 4 bytes) is among the counted all-reduces of every run.
Recipes that store bf16 variables (``bf16-master``...) cannot be created under this strategy (it broadcasts each
initial value with ``CollectiveBcastSend``, which has no bfloat16 kernel): their rows say so.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

WORKERS = 2
COLLECTIVES = {"CollectiveReduceV2": "all_reduce", "CollectiveReduce": "all_reduce", "CollectiveReduceV3":
               "all_reduce", "CollectiveGatherV2": "all_gather", "CollectiveGather": "all_gather",
               "CollectiveReduceScatterV2": "reduce_scatter", "NcclAllReduce": "all_reduce"}


def graph_bytes(graph: Any) -> dict[str, dict[str, int]]:
    """``{op: {dtype: bytes}}`` handed to the collective ops of ``graph`` and of every function it calls."""
    import numpy as np

    out: dict[str, dict[str, int]] = {}
    seen: set[int] = set()

    def walk(g: Any) -> None:
        if id(g) in seen:
            return
        seen.add(id(g))
        for op in g.get_operations():
            if op.type in COLLECTIVES:
                t = op.inputs[0]
                n = int(np.prod(t.shape.as_list())) if t.shape.is_fully_defined() else -1
                per = out.setdefault(COLLECTIVES[op.type], {})
                per[t.dtype.name] = per.get(t.dtype.name, 0) + n * t.dtype.size
        for f in getattr(g, "_functions", {}).values():
            inner = getattr(f, "graph", None)
            if inner is not None:
                walk(inner)

    walk(graph)
    return out


def worker(argv: list[str]) -> None:
    """One MultiWorkerMirroredStrategy worker: every recipe x comm_dtype; index 0 writes the results."""
    import logging
    import warnings

    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    strategy = tf.distribute.MultiWorkerMirroredStrategy()  # before any other TF op (it reads TF_CONFIG)
    warnings.filterwarnings("ignore")
    logging.getLogger("tensorflow").setLevel(logging.ERROR)
    import keras
    import numpy as np
    from scale_out import parse
    from sklearn.datasets import load_digits

    import keras_ext
    from mp_callbacks import get_recipe

    args = parse(argv)
    index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    digits = load_digits()
    x_all = (digits.data / 16.0).astype(np.float32)
    y_all = digits.target.astype(np.int64)
    rng = np.random.default_rng(0)  # the global batches: the same for every run (as torch_models.digits draws them)
    idx = [rng.choice(len(x_all), WORKERS * args.batch_size, replace=False) for _ in range(args.steps)]
    results = []
    for recipe in args.recipes:
        for comm in args.comms:
            row: dict[str, Any] = {"part": "keras", "run": f"ours {recipe}", "recipe": recipe, "comm_dtype": comm}
            if get_recipe(recipe).master.param_dtype != "float32":
                results.append({**row, "bytes": {}, "losses": [], "skipped": None, "steps": 0,
                                "note": "not run: bf16 variables cannot be created under MultiWorkerMirroredStrategy"})
                continue
            results.append({**row, **train(strategy, keras, keras_ext, get_recipe(recipe, comm_dtype=comm), args,
                                           x_all, y_all, idx, index)})
    if "bf16-mixed" in args.recipes:  # Keras' own: mixed_bfloat16 and its AdamW, the gradients reduced as they are
        results.append({"part": "keras", "run": "native bf16-mixed", "recipe": "bf16-mixed", "comm_dtype": "float32",
                        **train(strategy, keras, None, "mixed_bfloat16", args, x_all, y_all, idx, index)})
    if index == 0:
        with open(args.out, "w") as fh:
            json.dump(results, fh)


def train(strategy: Any, keras: Any, keras_ext: Any, recipe: Any, args: Any, x_all: Any, y_all: Any, idx: list,
          index: int) -> dict:
    import tensorflow as tf

    """Train one run (``keras_ext`` None: Keras' own policy named by ``recipe``); its bytes, losses, skips."""
    before = keras.config.dtype_policy()
    with strategy.scope():
        keras.utils.set_random_seed(0)
        keras.config.set_dtype_policy("float32" if keras_ext is not None else recipe)
        model = keras.Sequential([keras.Input((64,)), *[keras.layers.Dense(args.hidden, activation="relu")
                                                        for _ in range(args.depth)], keras.layers.Dense(10)])
        if keras_ext is not None:
            keras_ext.set_global_policy(recipe)
            model = keras_ext.apply_policy(model)
        keras.config.set_dtype_policy(before)
        opt = keras.optimizers.AdamW(1e-3)
        if keras_ext is not None:
            opt = keras_ext.master_optimizer(opt, recipe)
        opt.build(model.trainable_variables)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="sum")
    global_batch = WORKERS * args.batch_size

    def replica_step(x: Any, y: Any) -> Any:
        with tf.GradientTape() as tape:
            loss = loss_fn(y, tf.cast(model(x, training=True), tf.float32)) / global_batch
            scaled = opt.scale_loss(loss)
        grads = tape.gradient(scaled, model.trainable_variables)
        opt.apply(grads, model.trainable_variables)
        return loss

    @tf.function
    def step(x: Any, y: Any) -> Any:
        return strategy.reduce(tf.distribute.ReduceOp.SUM, strategy.run(replica_step, args=(x, y)), axis=None)

    half = slice(index * args.batch_size, (index + 1) * args.batch_size)
    losses = [float(step(tf.constant(x_all[i[half]]), tf.constant(y_all[i[half]]))) for i in idx]
    graph = step.get_concrete_function(tf.constant(x_all[idx[0][half]]), tf.constant(y_all[idx[0][half]])).graph
    return {"bytes": graph_bytes(graph), "losses": losses, "skipped": int(getattr(opt, "skipped", 0) or 0),
            "steps": len(losses)}


def run(args: Any, tmp: str) -> list[dict]:
    """Launch the two workers; rank 0's results."""
    out = os.path.join(tmp, "keras.json")
    socks = [socket.socket() for _ in range(WORKERS)]
    for s in socks:
        s.bind(("localhost", 0))
    cluster = {"worker": [f"localhost:{s.getsockname()[1]}" for s in socks]}
    for s in socks:
        s.close()
    argv = ["--recipes", *args.recipes, "--comms", *args.comms, "--steps", str(args.steps), "--hidden",
            str(args.hidden), "--depth", str(args.depth), "--batch-size", str(args.batch_size), "--out", out]
    env = {**os.environ, "KERAS_BACKEND": "tensorflow", "TF_CPP_MIN_LOG_LEVEL": "2", "OMP_NUM_THREADS": "1",
           "PYTHONWARNINGS": "ignore"}
    procs = [subprocess.Popen([sys.executable, str(Path(__file__).resolve()), *argv], cwd=ROOT,
                              env={**env, "TF_CONFIG": json.dumps({"cluster": cluster,
                                                                   "task": {"type": "worker", "index": i}})},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(WORKERS)]
    logs = [p.communicate()[0] for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError("a Keras worker failed:\n" + "\n".join(log[-3000:] for log in logs))
    with open(out) as fh:
        return json.load(fh)


if __name__ == "__main__":
    worker(sys.argv[1:])
