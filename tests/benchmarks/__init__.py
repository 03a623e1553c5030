"""Tests of the benchmark scripts (that they keep running; no timing is asserted)."""
