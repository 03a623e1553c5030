"""Smoke tests of the benchmark scripts (benchmarks/): each runs on a tiny size in a few seconds."""

TINY = ["--d-model", "32", "--layers", "1", "--seq", "8", "--vocab", "64", "--batch-size", "2"]
"""The transformer's size in the smoke tests."""
