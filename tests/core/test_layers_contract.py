"""The import-linter contracts in pyproject.toml hold the tree's shape; this checks they cover it.

The first contract forbids the core below the app to import an adapter, the app or a framework.
It names the core's modules one by one, so a new core module must be added there: this test
fails until it is.
"""

from __future__ import annotations

import pkgutil
from pathlib import Path

import tomllib

import mp_callbacks

ROOT = Path(__file__).resolve().parents[2]


def contracts() -> list[dict]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]


def test_the_core_contract_names_every_core_module():
    core = next(c for c in contracts() if c["type"] == "forbidden" and "mp_callbacks.app" in c["forbidden_modules"]
                and "mp_callbacks.ops" in c["source_modules"])
    top = {f"mp_callbacks.{m.name}" for m in pkgutil.iter_modules(mp_callbacks.__path__)} - {
        "mp_callbacks.app", "mp_callbacks.__main__"}
    assert set(core["source_modules"]) == top
    assert {"lightning_ext", "keras_ext", "torch", "keras", "tensorflow", "jax"} <= set(core["forbidden_modules"])


def test_every_package_is_checked_for_circles():
    acyclic = next(c for c in contracts() if c["type"] == "acyclic_siblings")
    assert set(acyclic["ancestors"]) == {"mp_callbacks", "lightning_ext", "keras_ext"}
    independence = next(c for c in contracts() if c["type"] == "independence")
    assert set(independence["modules"]) == {"lightning_ext", "keras_ext"}
