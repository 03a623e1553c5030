"""MirroredStrategy on 2 logical CPU devices (fresh process: the device split must precede TF init)."""

import json

from keras_testutil import run_script


def test_one_replica_overflow_makes_every_replica_skip():
    proc = run_script("mirrored_script.py", "ours", "fit", "fit_master")
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(l for l in proc.stdout.splitlines() if l.startswith("RESULT "))
    result = json.loads(line[len("RESULT "):])

    loop = result["ours"]
    assert loop["replicas"] == 2
    # Steps 1 and 4 overflow on replica 1 only: the flag is all-reduced, both replicas skip.
    assert loop["unchanged_on_bad"] == [True, True]
    assert loop["skipped"] == loop["overflows"] == 2 and loop["steps"] == 6
    assert loop["iterations"] == 4
    assert loop["weights_equal_across_replicas"] and loop["finite"]
    assert loop["scales"] == [32768.0, 16384.0, 16384.0, 32768.0, 16384.0, 16384.0]

    for kind, masters in (("fit", 0), ("fit_master", 2)):
        fit = result[kind]
        assert fit["skipped"] == fit["overflows"] == 1 and fit["steps"] == 6 and fit["iterations"] == 5
        assert fit["weights_equal_across_replicas"] and fit["finite"]  # masters included
        assert fit["masters"] == masters
