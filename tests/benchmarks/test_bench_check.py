"""benchmarks/bench_check.py runs end to end on a small Hugging Face GPT-2: both ways of the check decide alike
after every real backward (the script asserts it) and it prints the ratios."""

import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

pytest.importorskip("transformers")
SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_check.py"


@pytest.mark.skipif(shutil.which("c++") is None or not (Path(sysconfig.get_paths()["include"]) / "Python.h").is_file(),
                    reason="no C++ compiler or no Python headers (the native check's build)")
def test_bench_check_runs_and_both_ways_agree():
    done = subprocess.run([sys.executable, str(SCRIPT), "--steps", "24", "--rounds", "2", "--layers", "1",
                           "--d-model", "32", "--no-pin"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "ratio Python path / native call" in done.stdout and "ratio native call (control)" in done.stdout
