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


def _deep_core_imports(path: Path) -> list[str]:
    """``mp_callbacks.<subpackage>.<module>`` imports in ``path`` (the subpackage's face is what others import)."""
    import ast

    packages = {m.name for m in pkgutil.iter_modules(mp_callbacks.__path__) if m.ispkg} - {"app"}
    package = ".".join(path.relative_to(ROOT).parent.parts)  # for relative imports (the app's)
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
            names = [node.module or ""] if not node.level else [f"{base}.{node.module}" if node.module else base]
        else:
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
        for name in names:
            parts = name.split(".")
            if len(parts) > 2 and parts[0] == "mp_callbacks" and parts[1] in packages:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {name}")
    return found


def test_everything_outside_the_core_imports_it_through_its_faces():
    """Adapters, the app, tests, examples, benchmarks and the drop-in runners import ``mp_callbacks`` and its
    subpackages (``mp_callbacks.loss_scale``, ``.fp8``, ``.weights``...), never a module inside a subpackage
    (the app, the ``mpx`` program, is not a library face: its tests reach its modules)."""
    places = [ROOT / d for d in ("lightning_ext", "keras_ext", "tests", "examples", "benchmarks", "dropin")]
    places.append(ROOT / "mp_callbacks" / "app")
    deep = [hit for place in places for path in sorted(place.rglob("*.py")) for hit in _deep_core_imports(path)]
    assert not deep, "import these through the subpackage's __init__:\n" + "\n".join(deep)
