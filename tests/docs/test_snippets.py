"""Every Python block of the README and the docs runs (see :mod:`tests.docs.snippets` for the rules)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.docs.snippets import ROOT, SNIPPET_ENV, all_blocks, blocks, markdown_files

PAGES = [f for f in markdown_files() if any(not b.reduced for b in blocks(f))]
REDUCED = sorted({b.reduced for b in all_blocks() if b.reduced})


def _run(args: list[str], cwd, timeout: int) -> subprocess.CompletedProcess:
    env = {**os.environ, **SNIPPET_ENV, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT),
                                                                                   os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_page_snippets_run(page, tmp_path):
    proc = _run(["-m", "tests.docs.run_snippets", str(page)], tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]


@pytest.mark.parametrize("script", REDUCED)
def test_reduced_form_runs(script, tmp_path):
    proc = _run([str(ROOT / script)], tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]


def test_every_marker_names_an_existing_script_and_a_reason():
    marked = [b for b in all_blocks() if b.reduced]
    for b in marked:
        assert (ROOT / b.reduced).is_file(), f"{b.where}: no reduced form {b.reduced}"
        assert b.reason, f"{b.where}: say why the block cannot run as it stands"


def test_the_collector_finds_the_blocks():
    found = all_blocks()
    assert len(found) >= 10 and any(b.path.name == "getting-started.md" for b in found)
