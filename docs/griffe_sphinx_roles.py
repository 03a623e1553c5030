"""A griffe extension for the docs build: Sphinx roles render as code, doctests as code blocks.

The project's docstrings are Google style ("Args:", "Attributes:") and name other objects with
Sphinx roles (``:class:`ScalerConfig```, ``:func:`.next_state```), which the mkdocstrings
handler does not understand.  This turns each role into inline code at load time (the role's
target, without a leading ``~`` or ``.``), so the page shows ``ScalerConfig`` rather than
``:class:`ScalerConfig```.  A doctest paragraph (lines from ``>>>`` to the next blank line)
outside a fenced block becomes a ``pycon`` code block (Markdown would read its output, e.g.
``['a', 'b']``, as a link).  The source files are not changed.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

ROLE = re.compile(r":(?:py:)?(?:class|func|meth|mod|data|attr|obj|exc|const|ref|term):`~?\.?([^`]+)`")


def plain_roles(text: str) -> str:
    """``:class:`~a.B``` -> ```B``` (the last part after ``~``), others -> ```target```."""

    def repl(match: re.Match[str]) -> str:
        target = match.group(1)
        if match.group(0).split("`", 1)[1].startswith("~"):
            target = target.rsplit(".", 1)[-1]
        return f"`{target}`"

    return ROLE.sub(repl, text)


def fence_doctests(text: str) -> str:
    """Wrap each doctest paragraph that is not in a code block already in a ``pycon`` fence."""
    out: list[str] = []
    in_fence = in_doctest = False
    indent = ""
    for line in text.splitlines():
        stripped = line.strip()
        if in_doctest and not stripped:
            out.append(f"{indent}```")
            in_doctest = False
        if stripped.startswith("```"):
            in_fence = not in_fence
        elif not in_fence and not in_doctest and stripped.startswith(">>>"):
            indent = line[: len(line) - len(line.lstrip())]
            out.append(f"{indent}```pycon")
            in_doctest = True
        out.append(line)
    if in_doctest:
        out.append(f"{indent}```")
    return "\n".join(out)


class SphinxRoles(griffe.Extension):
    """Rewrites every docstring: Sphinx roles as inline code, bare doctests as code blocks."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = fence_doctests(plain_roles(obj.docstring.value))
