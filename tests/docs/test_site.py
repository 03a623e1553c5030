"""The documentation site builds strictly, and its API reference covers every public name.

``mkdocs build --strict`` fails on a broken link or anchor, a reference the handler cannot resolve
and a docstring it cannot parse.  The coverage check reads the built API pages: every name in the
``__all__`` of a package or module of ``mp_callbacks``, ``lightning_ext`` and ``keras_ext`` must have
an entry (an anchor ``module.name``, or ``package.name`` on a package that re-exports it), so a new
module without its ``:::`` line in docs/api/ fails here."""

from __future__ import annotations

import ast
import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.docs.snippets import ROOT

PACKAGES = ("mp_callbacks", "lightning_ext", "keras_ext")


def build_site(out: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)


def public_names() -> dict[str, list[str]]:
    """``{module: its __all__}`` for every module of the three packages that defines one (read, not imported)."""
    found = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            tree = ast.parse(path.read_text(encoding="utf-8"))
            for node in tree.body:
                if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
                    parts = path.relative_to(ROOT).with_suffix("").parts
                    module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
                    found[module] = list(ast.literal_eval(node.value))
    return found


@pytest.fixture
def site(tmp_path):
    """A strict build of the site (one per test that needs it: xdist gives no fixture to share across workers)."""
    proc = build_site(tmp_path / "site")
    assert proc.returncode == 0, "mkdocs build --strict failed:\n" + proc.stdout[-3000:] + proc.stderr[-6000:]
    return tmp_path / "site"


def test_strict_build_and_api_coverage(site):
    """The strict build passes, writes every page (the benchmarks page with benchmarks/README.md in it), and its
    API pages have an entry for every public name."""
    for page in ("index.html", "guides/recipes/index.html", "guides/benchmarks/index.html", "api/keras_ext/index.html"):
        assert (site / page).is_file(), page
    bench = (site / "guides/benchmarks/index.html").read_text(encoding="utf-8")
    assert "How each one measures" in bench, "the benchmarks page includes benchmarks/README.md"
    ids = set()
    for page in (site / "api").rglob("*.html"):
        ids.update(re.findall(r'id="([A-Za-z_][\w.]*)"', page.read_text(encoding="utf-8")))
    missing = []
    for module, names in public_names().items():
        parents = [".".join(module.split(".")[:i]) for i in range(1, module.count(".") + 1)]
        for name in names:
            here = any(f"{m}.{name}" in ids for m in [module, *parents])
            # a package's face re-exports: the name may be documented where it is defined, below the package
            below = any(i.startswith(module + ".") and i.endswith("." + name) for i in ids)
            if not (here or below):  # an alias (``FabricMixedPrecision``): documented under its own name
                obj = getattr(importlib.import_module(module), name, None)
                where = f"{getattr(obj, '__module__', '')}.{getattr(obj, '__qualname__', '')}"
                below = where in ids
            if not (here or below):
                missing.append(f"{module}.{name}")
    assert not missing, f"no API entry (add the module to a page of docs/api/): {missing}"


def test_readme_links_point_at_files():
    """The README's relative links name files of the repository."""
    for readme in (ROOT / "README.md",):
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", readme.read_text(encoding="utf-8")):
            if "://" not in target:
                assert (ROOT / target).exists(), f"{readme.name}: broken link {target}"
