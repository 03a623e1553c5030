"""The core demo runs and bad flags get a clear message."""

import subprocess
import sys


def _run(*args):
    return subprocess.run([sys.executable, "-m", "mp_callbacks", *args], capture_output=True, text=True)


def test_demo_prints_every_preset_and_recipe():
    out = _run("presets", "--steps", "400", "--growth-interval", "20")
    assert out.returncode == 0, out.stderr
    for name in ("torch", "keras", "tf-keras", "megatron", "deepspeed", "apex", "jmp", "bf16-master"):
        assert name in out.stdout


def test_bad_flags_are_named():
    out = _run("presets", "--rate", "2")
    assert out.returncode == 2 and "--rate: 2.0 must be in [0, 1]" in out.stderr
    out = _run("nonsense")
    assert out.returncode == 2 and "invalid choice" in out.stderr
