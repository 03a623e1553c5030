"""harness.py: turns (every variant once per round, a fresh seeded order, never twice in a row), controls, and the
per-round ratios it reports."""

from __future__ import annotations

import time

import harness
import pytest
from harness import Variant, _Turns


def _sequence(n: int, rounds: int, seed: int = 0) -> list[int]:
    turns = _Turns(n, seed)
    out = []
    for _ in range(n * rounds):
        out.append(turns.current())
        turns.passed()
    return out


def test_rounds_are_permutations_with_varied_predecessors_and_no_repeats():
    n, rounds = 5, 200
    seq = _sequence(n, rounds)
    for r in range(rounds):
        assert sorted(seq[r * n:(r + 1) * n]) == list(range(n))
    assert all(a != b for a, b in zip(seq, seq[1:]))  # never the same variant twice in a row
    predecessors = {i: {a for a, b in zip(seq, seq[1:]) if b == i} for i in range(n)}
    assert all(len(p) == n - 1 for p in predecessors.values())  # every other variant precedes each one
    assert seq == _sequence(n, rounds)  # seeded: the same run repeats
    assert _sequence(2, 4) == [0, 1] * 4


def _sleeper(seconds: float, log: list[str], name: str) -> harness.Build:
    def build(clock: harness.Clock):
        def step() -> None:
            log.append(name)
            time.sleep(seconds)
        return harness.loop(clock, step)
    return build


def test_run_rounds_takes_turns_of_whole_rounds_and_reports_each_round():
    log: list[str] = []
    variants = {"slow": _sleeper(0.004, log, "slow"), "fast": _sleeper(0.002, log, "fast")}
    times = harness.run_rounds(harness.with_controls(variants, ["fast"]), rounds=3, steps=2, warmup=1)
    assert set(times) == {"slow", "fast", "fast (control)"}
    assert all(len(ts) == 3 for ts in times.values())
    # the lead (a copy of "slow") and the three variants: 1 + 3 * 2 steps each, in blocks of a turn
    assert log.count("slow") == 2 * 7 and log.count("fast") == 2 * 7
    blocks = [log[0]] + [b for a, b in zip(log, log[1:]) if a != b]
    assert len(blocks) <= 4 * 4  # one block per variant per turn (warm-up and 3 rounds), consecutive steps
    data = harness.summarize(times, [("slow", "fast")])
    row = data["ratios"][0]
    assert 1.3 < row["wall"]["median"] < 3 and row["wall"]["min"] <= row["wall"]["median"] <= row["wall"]["max"]
    assert 0.5 < row["control_wall"]["median"] < 2  # the same variant twice: near 1
    text = harness.markdown("title", data)
    assert "| slow | fast |" in text and "| fast (control) |" in text


def test_a_failing_variant_stops_the_run_with_its_error():
    def broken(clock: harness.Clock):
        def step() -> None:
            raise ValueError("no step")
        return harness.loop(clock, step)

    with pytest.raises(RuntimeError, match="'broken' failed: ValueError: no step"):
        harness.run_rounds({"ok": _sleeper(0, [], "ok"), "broken": broken}, rounds=2, steps=2, lead=False)


def test_variants_name_their_native_reference():
    assert Variant("ours", "bf16-master").reference() == Variant("native", "bf16-mixed")
    assert Variant("ours", "16-master").reference().name == "native 16-mixed"
    assert Variant("ours", "bf16-master", "fused").reference().name == "native bf16-mixed, AdamW(fused=True)"
    with pytest.raises(ValueError):
        Variant("native", "bf16-master")
    assert "CPU:" in harness.machine_line(1) and "1 thread(s)" in harness.machine_line(1)
