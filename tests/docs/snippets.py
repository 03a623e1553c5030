"""The Python code blocks of the docs and the README, as the snippet tests see them.

Every ```` ```python ```` block of ``README.md`` and ``docs/**/*.md`` runs
(:mod:`tests.docs.run_snippets`): the blocks of one page in order, in one namespace (a page reads
like a session), in a fresh process of their own, in a temporary directory.  Two things reduce a
run, and each says so where it is used:

* Lightning's ``Trainer`` takes its defaults from ``PL_TRAINER_*`` variables
  (:data:`SNIPPET_ENV`): a snippet's ``Trainer(...)`` without ``max_steps`` stops after a few steps,
  without progress bar, logger or checkpoint files unless the snippet asks for them.
* A block that needs several processes, nodes or GPUs is marked on the line just above it with
  ``<!-- docs-test: reduced tests/docs/reduced/NAME.py (why) -->``: it is not run as it stands; the
  script named there runs instead, the same code on one CPU process (its docstring says what it
  reduces).  No other marker exists: a block is run, or it is reduced.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([^\s`{]*)(.*)$")
MARKER = re.compile(r"^\s*<!--\s*docs-test:\s*reduced\s+(\S+)\s*(?:\((.+)\))?\s*-->\s*$")
ANY_MARKER = re.compile(r"<!--\s*docs-test:")
PYTHON = {"python", "py", "python3"}

SNIPPET_ENV = {
    "PL_TRAINER_MAX_STEPS": "3",
    "PL_TRAINER_ENABLE_PROGRESS_BAR": "False",
    "PL_TRAINER_ENABLE_MODEL_SUMMARY": "False",
    "PL_TRAINER_LOGGER": "False",
    "PL_TRAINER_ENABLE_CHECKPOINTING": "False",
    "MPLBACKEND": "Agg",
    "TF_CPP_MIN_LOG_LEVEL": "2",
}
"""The environment every snippet runs in (on top of the caller's)."""


@dataclasses.dataclass(frozen=True)
class Block:
    """One fenced Python block: where it is, its code, and the reduced script that stands in for it."""

    path: Path
    line: int  # 1-based line of the opening fence
    code: str
    reduced: str | None = None
    reason: str | None = None

    @property
    def where(self) -> str:
        path = self.path.relative_to(ROOT) if self.path.is_relative_to(ROOT) else self.path
        return f"{path}:{self.line}"


def markdown_files() -> list[Path]:
    """The pages whose blocks run: the README and every page under docs/."""
    files = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    return [f for f in files if f.is_file()]


def blocks(path: Path) -> list[Block]:
    """The Python blocks of one Markdown file, in order (a marker must sit on the line above its fence)."""
    lines = path.read_text(encoding="utf-8").splitlines()
    out: list[Block] = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            if ANY_MARKER.search(lines[i]) and not MARKER.match(lines[i]):
                raise ValueError(f"{path}:{i + 1}: malformed docs-test marker {lines[i]!r}")
            i += 1
            continue
        indent, fence, lang = m.group(1), m.group(2), m.group(3).lower()
        end = i + 1
        while end < len(lines) and not lines[end].strip().startswith(fence):
            end += 1
        if lang in PYTHON:
            code = "\n".join(line[len(indent):] if line.startswith(indent) else line for line in lines[i + 1:end])
            prev = lines[i - 1] if i > 0 else ""
            mark = MARKER.match(prev)
            reduced, reason = (mark.group(1), mark.group(2)) if mark else (None, None)
            out.append(Block(path, i + 1, code + "\n", reduced, reason))
        i = end + 1
    return out


def all_blocks() -> list[Block]:
    return [b for f in markdown_files() for b in blocks(f)]
