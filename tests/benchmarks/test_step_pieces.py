"""benchmarks/step_pieces.py's accounting: a piece's time excludes the wrapped pieces it calls."""

import sys
import time
import types
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
pytest.importorskip("transformers")

from step_pieces import Pieces  # noqa: E402


def test_exclusive_time_leaves_out_the_wrapped_callee() -> None:
    ns = types.SimpleNamespace()
    ns.inner = lambda: time.sleep(0.03)

    def outer() -> str:
        time.sleep(0.01)
        ns.inner()
        return "done"

    ns.outer = outer
    pieces = Pieces()
    pieces.wrap(ns, "inner", "inner")
    pieces.wrap(ns, "outer", "outer")
    t0 = time.perf_counter_ns()
    assert ns.outer() == "done"
    total = time.perf_counter_ns() - t0
    assert 0.009e9 < pieces.now["outer"] < 0.025e9  # its own 10 ms, not the callee's 30
    assert pieces.now["inner"] >= 0.03e9
    assert pieces.now["outer"] + pieces.now["inner"] <= total
