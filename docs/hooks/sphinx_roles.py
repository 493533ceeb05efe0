"""MkDocs hook: the docstrings' Sphinx roles read as code in the API reference.

The docstrings cross-reference with reStructuredText roles (``:class:`Guard```, ``:meth:`~.TrainStep.update```),
which mkdocstrings' Markdown leaves as text (":meth:" before the code). This drops the role and, for a ``~``
target, keeps only its last component, as Sphinx shows it; and the ``::`` that introduces a literal block (which
Markdown shows as a code block already) reads as one colon, or goes where it stood alone.
"""

from __future__ import annotations

import re

_LITERAL = re.compile(r"(?<=\S)::</p>")
_ROLE = re.compile(r":(?:meth|class|func|mod|data|attr|exc|obj|const):<code>(~?)\.?([^<]*)</code>")


def _code(match: re.Match) -> str:
    short, target = match.group(1), match.group(2)
    return f"<code>{target.rsplit('.', 1)[-1] if short else target}</code>"


def on_page_content(html: str, page, config, files) -> str:  # noqa: ANN001 (MkDocs' hook signature)
    return _LITERAL.sub(":</p>", _ROLE.sub(_code, html)).replace("<p>::</p>", "")
