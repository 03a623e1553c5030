"""Run the Python blocks of one Markdown page in order, in one namespace: ``python -m tests.docs.run_snippets PAGE``.

Blocks marked ``reduced`` are left out (their scripts run as tests of their own).  A failing block
stops the page: the exit status is 1 and the message names the block's line."""

from __future__ import annotations

import sys
import traceback
from pathlib import Path

from tests.docs.snippets import blocks


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


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
