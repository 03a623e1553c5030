"""Communication precision under ``tf.distribute`` (Keras): bytes all-reduced per step and the loss against FP32.

    python benchmarks/bench_comm_dtype_keras.py [--steps 60] [--hidden 64] [--depth 2] [--batch-size 32]
                                                [--recipes 16-mixed bf16-mixed bf16-master] [--json PATH]

The Keras twin of ``bench_comm_dtype.py``.  Launches 2 local workers of
``tf.distribute.MultiWorkerMirroredStrategy`` (``TF_CONFIG`` on localhost, one CPU replica per worker,
gRPC collectives).  Recipes that store bf16 weights (``bf16-master``) cannot create their model there
(the strategy broadcasts initial values with ``CollectiveBcastSend``, which has no bfloat16 kernel):
they run in one process under ``MirroredStrategy`` on 2 logical CPU devices; the table says which.
For each recipe and each ``comm_dtype`` (float32, bfloat16, float16) the runners' MLP
(``mp_callbacks.app.keras_runner.mlp`` under the recipe's policy, ``keras_ext.master_optimizer`` with the recipe's
``comm_dtype``) trains on scikit-learn's digits with ``model.fit`` (``keras_ext.distributed.multi_worker_fit``
under MultiWorkerMirroredStrategy), the same seed and the same per-replica batches
(``distribute_datasets_from_function``: replica i reads half i of each global batch).  What a step
hands to the all-reduce is recorded by ``keras_ext.distributed.CommCounter`` when the step is traced
(counted, not estimated: the gradients on Keras' own FP32 path and on keras_ext's ``comm_dtype`` path,
and the flags; per replica); the core's ``allreduce_bytes`` is printed beside it.
Losses: each step's loss (the mean over both workers, as Keras logs it), the largest per-step
difference against the FP32-communication run, and the final loss of the whole training set computed
in FP32 from the trained FP32 weights (the masters under ``*-master``).  Also printed: the CPU model
and the steps skipped (an fp16 reduction of loss-scaled gradients can overflow).  Float16 matmuls are
very slow in TensorFlow on CPUs without AVX-512 FP16/AMX, hence the small default MLP.  No
thresholds: figures only.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import machine_line, write_json  # noqa: E402

COMMS = ("float32", "bfloat16", "float16")
WORKERS = 2


def parse(argv: list[str]):
    import argparse

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=32, help="per worker")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--recipes", nargs="+", default=["16-mixed", "bf16-mixed", "bf16-master"])
    parser.add_argument("--json", default=None, metavar="PATH")
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)  # a worker's results (internal)
    return parser.parse_args(argv)


def run_one(strategy, recipe: str, comm: str, args, data, worker: int) -> dict:
    import keras
    import numpy as np
    import tensorflow as tf

    import keras_ext
    from keras_ext.distributed import CommCounter, multi_worker_fit
    from mp_callbacks import get_recipe
    from mp_callbacks.app.compare import RunSpec, batch_indices
    from mp_callbacks.app.keras_runner import graph_options, mlp

    x, y = data
    spec = RunSpec(steps=args.steps, batch_size=WORKERS * args.batch_size, hidden=args.hidden, depth=args.depth)
    idx = batch_indices(len(x), spec)  # (steps, global batch): the same for every run
    before = keras.config.dtype_policy()
    with strategy.scope():
        keras.utils.set_random_seed(0)
        keras.config.set_dtype_policy("float32")  # initial weights drawn in FP32 for every recipe (as the runners)
        model = mlp(args.hidden, args.depth)
        keras_ext.set_global_policy(recipe)
        model = keras_ext.apply_policy(model)
        keras.config.set_dtype_policy(before)
        opt = keras_ext.master_optimizer(keras.optimizers.AdamW(args.lr), get_recipe(recipe, comm_dtype=comm),
                                         count_overflows=True)
        model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    if isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
        multi_worker_fit(model)  # Keras 3's fit fails there without it

    def dataset_fn(ctx):  # one element = one replica's batch: replica i reads half i of each global batch
        if ctx.num_input_pipelines == WORKERS:  # a worker of MultiWorkerMirroredStrategy: its own half
            b = ctx.input_pipeline_id * args.batch_size
            part = idx[:, b:b + args.batch_size]
        else:  # MirroredStrategy: one pipeline, elements handed to the replicas in turn (step 0 half 0, half 1, ...)
            part = idx.reshape(-1, args.batch_size)
        return tf.data.Dataset.from_tensor_slices((x[part], y[part]))

    losses: list[float] = []

    class PerStep(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            losses.append(float(logs["loss"]))  # the mean over replicas of this step's loss
            self.model.reset_metrics()  # else the next log is the running mean over the epoch

    with CommCounter() as counter, graph_options():
        model.fit(strategy.distribute_datasets_from_function(dataset_fn), epochs=1, steps_per_epoch=args.steps,
                  verbose=0, callbacks=[PerStep()])
    masters = opt.master_variables or [None] * len(model.trainable_variables)
    weights = [np.asarray(keras.ops.convert_to_numpy(keras.ops.cast(m if m is not None else v, "float32")))
               for v, m in zip(model.trainable_variables, masters)]
    keras.config.set_dtype_policy("float32")
    fp32 = mlp(args.hidden, args.depth)  # the whole training set, in FP32, from the FP32 weights
    fp32.set_weights(weights)
    final = float(keras.losses.SparseCategoricalCrossentropy(from_logits=True)(y, fp32(x)))
    keras.config.set_dtype_policy(before)
    grads = counter.bytes_of("gradients")
    return {"losses": losses, "final_loss": final, "bytes": grads[0] if grads else 0, "traces": len(grads),
            "by_dtype": counter.by_dtype("gradients"), "flag_bytes": (counter.bytes_of("other") or [0])[0],
            "numels": [int(np.prod(v.shape)) for v in model.trainable_variables],
            "skipped": opt.skipped, "steps": opt.steps, "worker": worker}


def worker(argv: list[str]) -> None:
    """One process: a MultiWorkerMirroredStrategy worker (``TF_CONFIG``), or the MirroredStrategy run."""
    import logging
    import warnings

    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    import tensorflow as tf

    mirrored = "TF_CONFIG" not in os.environ
    if mirrored:  # 2 logical CPU devices, one replica each
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * WORKERS)
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    strategy = (tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(WORKERS)]) if mirrored
                else tf.distribute.MultiWorkerMirroredStrategy())  # before any other TF op (reads TF_CONFIG)
    warnings.filterwarnings("ignore")
    logging.getLogger("tensorflow").setLevel(logging.ERROR)

    from mp_callbacks.app.compare import digits_data

    args = parse(argv)
    index = 0 if mirrored else json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    x, y, _, _ = digits_data()
    results = {r: {c: run_one(strategy, r, c, args, (x, y), index) for c in COMMS} for r in args.recipes}
    if index == 0:
        kind = "MirroredStrategy" if mirrored else "MultiWorkerMirroredStrategy"
        with open(args.out, "w") as fh:
            json.dump({"strategy": kind, "replicas": strategy.num_replicas_in_sync, "results": results}, fh)


def report(runs: list[dict], args) -> None:
    from mp_callbacks.memory import allreduce_bytes

    print(machine_line(1))
    print(f"model.fit, MLP 64-{'-'.join([str(args.hidden)] * args.depth)}-10, {args.steps} steps, "
          f"batch {args.batch_size} per replica, AdamW lr {args.lr}, {WORKERS} replicas (one CPU thread each)")
    rows = []
    for run in runs:
        for recipe, by_comm in run["results"].items():
            base = by_comm["float32"]
            print(f"\n{recipe} ({run['strategy']}, {run['replicas']} replicas):")
            print(f"  {'comm_dtype':<10} {'bytes/step counted':>19} {'core figure':>12} {'grad dtypes':>18} "
                  f"{'skipped':>7} {'final loss':>11} {'vs fp32':>10} {'max |dloss| per step':>21}")
            for comm, r in by_comm.items():
                paper = allreduce_bytes(r["numels"], comm)
                diff = max(abs(a - b) for a, b in zip(r["losses"], base["losses"]))
                dtypes = ",".join(sorted(r["by_dtype"]))
                print(f"  {comm:<10} {r['bytes']:>19d} {paper:>12d} {dtypes:>18} {r['skipped']:>7d} "
                      f"{r['final_loss']:>11.5f} {r['final_loss'] - base['final_loss']:>+10.5f} {diff:>21.5f}")
                rows.append({"recipe": recipe, "strategy": run["strategy"], "comm_dtype": comm,
                             "bytes_per_step": r["bytes"], "core_bytes": paper, "by_dtype": r["by_dtype"],
                             "traces": r["traces"], "skipped": r["skipped"], "steps": r["steps"],
                             "final_loss": r["final_loss"], "final_loss_vs_fp32": r["final_loss"] - base["final_loss"],
                             "max_step_loss_diff": diff, "flag_bytes": r["flag_bytes"], "numel": sum(r["numels"])})
    flags = sorted({r["flag_bytes"] for r in rows})
    print(f"\noverflow consensus: one all-reduce of {'/'.join(map(str, flags))} bytes per step and replica "
          f"(counted: the overflow and non-finite-loss flags, float32)")
    write_json(args.json, rows)


def _launch(recipes: list[str], out: str, mwms: bool) -> None:
    """The MultiWorkerMirroredStrategy workers (2 processes, TF_CONFIG on localhost), or one process
    with MirroredStrategy on 2 logical CPU devices; index 0 writes ``out``."""
    argv = [*sys.argv[1:], "--recipes", *recipes, "--out", out]
    env = {**os.environ, "KERAS_BACKEND": "tensorflow", "TF_CPP_MIN_LOG_LEVEL": "2", "OMP_NUM_THREADS": "1",
           "PYTHONWARNINGS": "ignore"}
    env.pop("TF_CONFIG", None)
    envs = [env]
    if mwms:
        socks = [socket.socket() for _ in range(WORKERS)]
        for s in socks:
            s.bind(("localhost", 0))
        cluster = {"worker": [f"localhost:{s.getsockname()[1]}" for s in socks]}
        for s in socks:
            s.close()
        envs = [{**env, "TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": "worker", "index": i}})}
                for i in range(WORKERS)]
    procs = [subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--worker", *argv], cwd=ROOT, env=e,
                              stdout=subprocess.DEVNULL if i else None, stderr=subprocess.STDOUT if i else None)
             for i, e in enumerate(envs)]
    codes = [p.wait() for p in procs]
    if max(codes):
        sys.exit(max(codes))


def main() -> None:
    if "--worker" in sys.argv:
        worker([a for a in sys.argv[1:] if a != "--worker"])
        return
    import tempfile

    from mp_callbacks import get_recipe

    args = parse(sys.argv[1:])
    # MultiWorkerMirroredStrategy broadcasts each variable's initial value from worker 0 with
    # CollectiveBcastSend, which has no bfloat16 kernel: recipes storing bf16 weights (bf16-master)
    # cannot create their model under it, and run under MirroredStrategy on 2 logical CPU devices.
    bf16_store = [r for r in args.recipes if get_recipe(r).master.param_dtype != "float32"]
    groups = [([r for r in args.recipes if r not in bf16_store], True), (bf16_store, False)]
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, (recipes, mwms) in enumerate(groups):
            if recipes:
                out = os.path.join(tmp, f"run{i}.json")
                _launch(recipes, out, mwms)
                with open(out) as fh:
                    runs.append(json.load(fh))
    report(runs, args)


if __name__ == "__main__":
    main()
