"""lockstep's turns: every fit once per round, a fresh seeded order each round, no fit twice in a row."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from lockstep import StepClock, _Turns, lockstep  # noqa: E402


def _sequence(n: int, rounds: int, seed: int = 0) -> list[int]:
    turns = _Turns(n, seed)
    out = []
    for _ in range(n * rounds):
        out.append(turns._current())
        turns.passed()
    return out


def test_rounds_are_permutations_with_varied_predecessors_and_no_repeats():
    n, rounds = 5, 200
    seq = _sequence(n, rounds)
    for r in range(rounds):
        assert sorted(seq[r * n:(r + 1) * n]) == list(range(n))
    assert all(a != b for a, b in zip(seq, seq[1:]))  # never the same fit twice in a row
    predecessors = {i: {a for a, b in zip(seq, seq[1:]) if b == i} for i in range(n)}
    assert all(len(p) == n - 1 for p in predecessors.values())  # every other fit precedes each one
    assert seq == _sequence(n, rounds)  # seeded: the same run repeats
    assert _sequence(2, 4) == [0, 1] * 4


def test_lockstep_runs_one_step_at_a_time_in_turn():
    log: list[str] = []

    def variant(name: str):
        def build(clock: StepClock):
            def train():
                for _ in range(6):
                    clock.begin()
                    log.append(name)
                    clock.end()
            return train
        return build

    out = lockstep({k: variant(k) for k in "abc"}, steps=6, windows=2, warmup=0, lead=False)
    assert sorted(out) == ["a", "b", "c"] and all(len(v) == 2 for v in out.values())
    for r in range(6):
        assert sorted(log[3 * r:3 * r + 3]) == ["a", "b", "c"]


def test_the_lead_is_a_copy_of_the_first_variant_built_first_and_left_out():
    built: list[str] = []
    log: list[str] = []

    def variant(name: str):
        def build(clock: StepClock):
            built.append(name)

            def train():
                for _ in range(4):
                    clock.begin()
                    log.append(name)
                    clock.end()
            return train
        return build

    out = lockstep({k: variant(k) for k in "ab"}, steps=4, windows=2, warmup=0)
    assert built == ["a", "a", "b"] and sorted(out) == ["a", "b"]  # the lead: a, built first, not reported
    for r in range(4):
        assert sorted(log[3 * r:3 * r + 3]) == ["a", "a", "b"]
