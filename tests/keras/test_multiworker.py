"""``tf.distribute.MultiWorkerMirroredStrategy`` with 2 local workers (``TF_CONFIG`` on localhost, two
processes, one launch): an inf in worker 1's batch only makes both workers skip; weights, Adam slots and
the scale stay equal across workers and equal the one-process run on the summed gradients; a run saved
to ``.keras`` and resumed equals the uninterrupted one; ``comm_dtype="bfloat16"`` all-reduces bf16
gradients between the workers, and a float16 reduction that overflows skips the step on both; ``model.fit``
(with ``keras_ext.distributed.multi_worker_fit``) behaves as the custom loop.
The worker: tests/keras/helpers/multiworker.py."""

import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

from mp_callbacks.memory import allreduce_bytes
from tests.keras.helpers.util import ROOT, requires_tf_backend

pytestmark = [pytest.mark.multiprocess, requires_tf_backend]


def _free_ports(n):
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("localhost", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    out = tmp_path_factory.mktemp("multiworker")
    cluster = {"worker": [f"localhost:{p}" for p in _free_ports(2)]}
    procs = []
    for index in range(2):
        env = dict(os.environ, KERAS_BACKEND="tensorflow", TF_CPP_MIN_LOG_LEVEL="2", OMP_NUM_THREADS="1",
                   TF_CONFIG=json.dumps({"cluster": cluster, "task": {"type": "worker", "index": index}}))
        procs.append(subprocess.Popen([sys.executable, "-m", "tests.keras.helpers.multiworker", str(out)], env=env,
                                      cwd=str(ROOT), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=420)[0])  # generous: the machine may be shared
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-4000:]
    return [json.loads((out / f"worker{i}.json").read_text()) for i in range(2)]


def _assert_same_state(a, b, exact=True):
    for key in ("skipped", "overflows", "steps", "iterations", "scale", "scales"):
        assert a[key] == b[key], key
    for key in ("weights", "slots"):
        for x, y in zip(a[key], b[key]):
            if exact:
                np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
            else:
                np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6, atol=1e-7)


def test_one_worker_overflow_makes_both_workers_skip(workers):
    w0, w1 = workers
    assert w0["replicas"] == w1["replicas"] == 2
    run = w0["uninterrupted"]
    # steps 1 and 4 overflow on worker 1 only: the flag is all-reduced, both skip and back off
    assert run["scales"] == [32768.0, 16384.0, 16384.0, 32768.0, 16384.0, 16384.0]
    assert run["skipped"] == run["overflows"] == 2 and run["steps"] == 6 and run["iterations"] == 4
    assert np.all(np.isfinite(np.concatenate([np.ravel(w) for w in run["weights"]])))
    _assert_same_state(w0["uninterrupted"], w1["uninterrupted"])  # equal across workers, bit for bit
    # against one process applying the sum of both workers' gradients (what the all-reduce computes)
    _assert_same_state(run, w0["reference"])


def test_resume_after_save_equals_uninterrupted(workers):
    for w in workers:
        assert w["resumed"]["optimizer"] == "LossScaleOptimizer"
        _assert_same_state(w["resumed"], w["uninterrupted"])


def test_bf16_communication_reduces_bf16_gradients_between_workers(workers):
    w0, w1 = workers
    run = w0["comm_bf16"]
    _assert_same_state(run, w1["comm_bf16"])
    assert run["skipped"] == run["overflows"] == 2 and run["scales"] == w0["uninterrupted"]["scales"]
    numels = [3 * 2, 2, 2 * 1, 1]
    # what one step hands to the all-reduce (one trace; one local replica per worker): bf16 gradients only
    assert run["reduced"] == [[["bfloat16", n] for n in numels], [["float32", 2]]]
    # (then the overflow and non-finite-loss flags); bytes per step: 11 elements x 2 B (float32: 44 B)
    counted = sum(n * {"bfloat16": 2, "float32": 4}[dt] for dt, n in run["reduced"][0])
    assert counted == allreduce_bytes(numels, "bfloat16") == 22
    # weights stay close to the FP32-communication run (bf16 rounding of the gradient sum)
    for a, b in zip(run["weights"], w0["uninterrupted"]["weights"]):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=0.02)


def test_fp16_reduction_that_overflows_skips_on_both_workers(workers):
    """Worker 0's step-2 gradients are finite in FP32 but beyond float16's 65504: FP32 communication
    (the one-process sum) applies the step, a float16 reduction overflows and both workers skip it."""
    w0, w1 = workers
    fp32, fp16 = w0["reference_big"], w0["comm_fp16_big"]
    _assert_same_state(fp16, w1["comm_fp16_big"])
    assert fp32["skipped"] == 2 and fp32["scales"][:3] == [32768.0, 16384.0, 16384.0]
    assert fp16["skipped"] == fp16["overflows"] == 3 and fp16["scales"][:3] == [32768.0, 16384.0, 8192.0]
    assert np.all(np.isfinite(np.concatenate([np.ravel(w) for w in fp16["weights"]])))


def test_model_fit_one_worker_overflow_makes_both_workers_skip(workers):
    """``model.fit`` (Keras' own train step) under the strategy, per-worker batches, an inf in worker 0's
    batch only: both workers skip those steps and end equal, bit for bit, to each other and to one
    process applying the sum of both workers' gradients."""
    w0, w1 = workers
    fit = w0["fit"]
    assert fit["scales"] == [32768.0, 16384.0, 16384.0, 32768.0, 16384.0, 16384.0]
    assert fit["skipped"] == fit["overflows"] == 2 and fit["steps"] == 6 and fit["iterations"] == 4
    assert np.all(np.isfinite(np.concatenate([np.ravel(w) for w in fit["weights"]])))
    _assert_same_state(fit, w1["fit"])
    _assert_same_state(fit, w0["reference_fit"])
    # FP32 communication: Keras' own gradient all-reduce, counted by keras_ext.distributed.CommCounter
    numels = [3 * 2, 2, 2 * 1, 1]
    assert fit["comm"]["gradients"] == [[["float32", n] for n in numels]]
    assert fit["grad_bytes"] == [allreduce_bytes(numels, "float32")]
    assert fit["comm"]["other"] == [[["float32", 2]]]  # the overflow and non-finite-loss flags


def test_multi_worker_fit_is_a_no_op_outside_multi_worker_strategies():
    import keras

    from keras_ext.distributed import multi_worker_fit

    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    assert multi_worker_fit(model) is model
    assert not {"train_step", "test_step", "_maybe_symbolic_build"} & set(vars(model))
