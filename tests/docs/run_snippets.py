"""Run the Python blocks of Markdown pages, each page in order in one namespace of its own.

``python -m tests.docs.run_snippets PAGE``: one page in this process.
``python -m tests.docs.run_snippets --fork OUTDIR PAGE...``: the libraries the pages use are imported
once, then each page runs in a fork of that process (a fresh copy in which no op has run, as a new
interpreter would be, without paying torch's, Lightning's and TensorFlow's imports per page); page
``i`` runs in ``OUTDIR/i`` with its output in ``OUTDIR/i/log`` and the exit statuses are printed as
JSON, one per page.

Blocks marked ``reduced`` are left out (their scripts run as tests of their own).  A failing block
stops the page: the exit status is 1 and the message names the block's line."""

from __future__ import annotations

import importlib
import json
import os
import signal
import sys
import traceback
from pathlib import Path

from tests.docs.snippets import blocks

PRELOAD = ("numpy", "torch", "lightning", "tensorflow", "keras", "mp_callbacks", "lightning_ext", "keras_ext")
"""Imported before the forks: every page imports some of them (importing runs no op, so no thread pool is
running when the process forks)."""
PAGE_TIMEOUT_S = 600


def main(page: str) -> int:
    path = Path(page).resolve()
    namespace: dict = {"__name__": "__main__"}
    ran = 0
    for block in blocks(path):
        if block.reduced:
            continue
        try:
            exec(compile(block.code, block.where, "exec"), namespace)  # noqa: S102 - the docs' own code
        except BaseException:  # noqa: BLE001 - report which block failed, then fail
            traceback.print_exc()
            print(f"SNIPPET FAILED: the block at {block.where}", file=sys.stderr)
            return 1
        ran += 1
    print(f"SNIPPETS OK: {ran} block(s) of {page}")
    return 0


def _run_forked(page: str, workdir: Path) -> int:
    """``main(page)`` in a child process with ``workdir`` as its directory; its exit status (-N: signal N)."""
    workdir.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        rc = 1
        try:
            log = os.open(workdir / "log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(log, 1)
            os.dup2(log, 2)
            os.chdir(workdir)
            signal.alarm(PAGE_TIMEOUT_S)  # SIGALRM ends a page that hangs
            rc = main(page)
        except BaseException:  # noqa: BLE001 - anything escaping main is the page's failure
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(rc)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def fork_each(outdir: str, pages: list[str]) -> list[dict]:
    for name in PRELOAD:
        importlib.import_module(name)
    return [{"page": page, "rc": _run_forked(page, Path(outdir) / str(i)), "log": str(Path(outdir) / str(i) / "log")}
            for i, page in enumerate(pages)]


if __name__ == "__main__":
    if sys.argv[1] == "--fork":
        print(json.dumps(fork_each(sys.argv[2], sys.argv[3:])))
        sys.exit(0)
    sys.exit(main(sys.argv[1]))
