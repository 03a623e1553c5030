"""Helpers shared by the test folders (not part of the core)."""
