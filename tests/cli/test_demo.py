"""``make demo`` sizes itself to the CPU: a slow low-precision matmul shrinks the model and says why."""

from mp_callbacks.app.cli import DEMO_ARGS, SLOW_FACTOR, SMALL_DEMO, demo_args, matmul_slowdown


def _value(args, flag):
    return args[args.index(flag) + 1]


def test_fast_low_precision_keeps_the_full_demo():
    args, note = demo_args({"float16": 1.2, "bfloat16": 0.6})
    assert args == list(DEMO_ARGS) and note is None


def test_a_slow_dtype_shrinks_the_demo_and_names_it():
    args, note = demo_args({"float16": SLOW_FACTOR * 10, "bfloat16": 0.6})
    assert _value(args, "--hidden") == SMALL_DEMO["--hidden"]
    assert _value(args, "--batch-size") == SMALL_DEMO["--batch-size"]
    assert _value(args, "--steps") == _value(list(DEMO_ARGS), "--steps")  # every recipe runs the same steps
    assert "float16 40x" in note and "bfloat16" not in note


def test_the_probe_reports_both_low_precision_dtypes():
    got = matmul_slowdown(n=32, repeats=1)
    assert set(got) == {"float16", "bfloat16"} and all(v > 0 for v in got.values())
