"""The native modules' shared test: a library built from a wrong source is refused by its load check."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest


def assert_wrong_source_refused(module: ModuleType, load: Callable[[], Any], stem: str, wrong: tuple[str, str],
                                match: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """``module.SOURCE`` with ``wrong`` replaced is built into a fresh cache, then ``load()`` warns (``match``)
    and answers None: the load check, not the build, refused it."""
    monkeypatch.setattr(module, "_loaded", [])
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    source = module.SOURCE.replace(*wrong)
    assert source != module.SOURCE
    monkeypatch.setattr(module, "SOURCE", source)
    with pytest.warns(RuntimeWarning, match=match):
        assert load() is None
    assert len(list((tmp_path / "mp_callbacks").glob(f"{stem}-*.so"))) == 1  # built, then refused
