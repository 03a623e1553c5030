"""Every Python block of the README and the docs runs (see :mod:`tests.docs.snippets` for the rules)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.docs.snippets import ROOT, SNIPPET_ENV, all_blocks, blocks, markdown_files

PAGES = [f for f in markdown_files() if any(not b.reduced for b in blocks(f))]
REDUCED = sorted({b.reduced for b in all_blocks() if b.reduced})


def _run(args: list[str], cwd, timeout: int) -> subprocess.CompletedProcess:
    env = {**os.environ, **SNIPPET_ENV, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT),
                                                                                   os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def page_runs(tmp_path_factory) -> dict[Path, dict]:
    """Every page run once, each in a fork of one process that imported the libraries (run_snippets --fork)."""
    out = tmp_path_factory.mktemp("pages")
    proc = _run(["-m", "tests.docs.run_snippets", "--fork", str(out), *map(str, PAGES)], out,
                timeout=600 * len(PAGES))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return {Path(run["page"]): run for run in json.loads(proc.stdout.strip().splitlines()[-1])}


# One xdist worker runs every page test, so the fixture runs once.
@pytest.mark.xdist_group("snippet_pages")
@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_page_snippets_run(page, page_runs):
    run = page_runs[page]
    log = Path(run["log"]).read_text(encoding="utf-8", errors="replace")
    assert run["rc"] == 0, f"exit status {run['rc']} (-14: over {600} s)\n" + log[-8000:]
    assert "SNIPPETS OK" in log


def test_a_failing_page_fails_alone_and_names_its_block(tmp_path):
    """Forked pages are independent: a page whose block raises reports it; the next page still runs."""
    bad, good = tmp_path / "bad.md", tmp_path / "good.md"
    bad.write_text("```python\nx = 1\n```\n\n```python\nraise ValueError('boom')\n```\n")
    good.write_text("```python\nassert 'x' not in globals()\nprint('fresh')\n```\n")
    code = ("import json, sys, tests.docs.run_snippets as r; r.PRELOAD = ('numpy',); "
            "print(json.dumps(r.fork_each(sys.argv[1], sys.argv[2:])))")
    proc = _run(["-c", code, str(tmp_path / "out"), str(bad), str(good)], tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = json.loads(proc.stdout.strip().splitlines()[-1])
    assert [r["rc"] for r in runs] == [1, 0]
    assert f"SNIPPET FAILED: the block at {bad}:5" in Path(runs[0]["log"]).read_text()
    assert "fresh" in Path(runs[1]["log"]).read_text()


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
